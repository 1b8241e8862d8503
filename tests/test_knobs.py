"""runtime/knobs.py is the one reader of kvrun's KVRUN_* environment settings: no other
module of the package reads one, every variable it reads is in its table, and each
function returns the normalized value (or the default) it documents."""
import re
from pathlib import Path

import pytest
import torch

from kvrun import knobs

ROOT = Path(__file__).resolve().parents[1]
READ = re.compile(r"""(?:environ\.get|environ\[|getenv)\(?\s*["'](KVRUN_\w+)""")


def test_no_module_but_knobs_reads_a_kvrun_variable():
    readers = {}
    for folder in ("runtime", "kernels", "convert"):
        for f in (ROOT / folder).rglob("*.py"):
            for name in READ.findall(f.read_text()):
                readers.setdefault(name, set()).add(f.relative_to(ROOT).as_posix())
    assert readers, "the pattern found no read at all"
    outside = {n: fs - {"runtime/knobs.py"} for n, fs in readers.items() if fs - {"runtime/knobs.py"}}
    assert not outside, f"KVRUN_* read outside runtime/knobs.py: {outside}"
    table = knobs.__doc__
    assert all(f"| {n} |" in table for n in readers), "a variable missing from knobs' table"


def test_values_are_normalized_and_defaulted(monkeypatch, tmp_path):
    for n in ("KVRUN_BACKEND", "KVRUN_GEMV", "KVRUN_ATTN", "KVRUN_NATIVE", "KVRUN_NATIVE_LIB",
              "KVRUN_DEBUG", "KVRUN_THREADS_ADAPT", "KVRUN_CHAT_HISTORY"):
        monkeypatch.delenv(n, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KVRUN_HOME", raising=False)
    assert knobs.home() == tmp_path / ".cache" / "kvrun"
    assert (knobs.backend(), knobs.gemv(), knobs.attn(), knobs.native()) == ("", "", "", "1")
    assert knobs.native_lib() is None and knobs.debug() is False and knobs.threads_adapt() is True
    assert knobs.chat_history() is None
    monkeypatch.setenv("KVRUN_BACKEND", "  Torch ")
    monkeypatch.setenv("KVRUN_ATTN", "FP32")
    monkeypatch.setenv("KVRUN_THREADS_ADAPT", "0")
    monkeypatch.setenv("KVRUN_HOME", str(tmp_path / "h"))
    monkeypatch.setenv("KVRUN_CHAT_HISTORY", "")
    assert knobs.backend() == "torch" and knobs.attn() == "fp32" and knobs.threads_adapt() is False
    assert knobs.home() == tmp_path / "h" and knobs.chat_history() == ""


@pytest.mark.parametrize("value", ["nonsense", "NATIVE2"])
def test_a_bad_backend_is_one_line_from_its_caller(monkeypatch, value):
    from kvrun.kernels.dispatch import BackendError, select
    monkeypatch.setenv("KVRUN_BACKEND", value)
    with pytest.raises(BackendError, match="KVRUN_BACKEND"):
        select("cpu")


def test_a_cache_reads_kvrun_attn_once(monkeypatch):
    """KVRUN_ATTN is read when a cache is built, not per attention call: a cache built under
    fp32 keeps stepping on fp32 after the variable changes (its outputs equal, bit for bit,
    those of a twin built and stepped under fp32), and one built under int steps on int."""
    from kvrun.kernels import native
    from kvrun.kv import build_cache, parse_kv
    from tiny import tiny_config
    if native.load() is None:
        pytest.skip("native kernels unavailable")
    cfg = tiny_config(num_heads=4, num_kv_heads=2, hidden_size=256)      # D 64
    kv = parse_kv("kivi-4", residual=32, group=32)
    g = torch.Generator().manual_seed(0)
    D, Hkv, H = cfg.head_dim, cfg.num_kv_heads, cfg.num_heads
    prompt = [torch.randn(cfg.num_layers, Hkv, 96, D, generator=g).half() for _ in range(2)]
    steps = [(torch.randn(1, H, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g),
              torch.randn(1, Hkv, 1, D, generator=g)) for _ in range(4)]

    def run(build_env, step_env):
        monkeypatch.setenv("KVRUN_ATTN", build_env)
        c = build_cache(cfg, 256, kv)
        c.ingest(*prompt)
        monkeypatch.setenv("KVRUN_ATTN", step_env)
        out = []
        for q, k, v in steps:
            c.positions(1)
            out.append(torch.cat([c.attend(l, q, k, v) for l in range(cfg.num_layers)]))
            c.commit(1)
        return c.attn, torch.stack(out)
    a_path, a = run("fp32", "int")
    b_path, b = run("fp32", "fp32")
    c_path, c = run("int", "fp32")
    assert a_path == b_path == "fp32" and c_path == "int"
    assert torch.equal(a, b)
    assert not torch.equal(a, c)            # the paths differ (int16-quantized products)
