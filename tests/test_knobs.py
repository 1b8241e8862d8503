"""runtime/knobs.py is the one reader of kvrun's KVRUN_* environment settings: no other
module of the package reads one, every variable it reads is in its table, and each
function returns the normalized value (or the default) it documents."""
import re
from pathlib import Path

import pytest

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
