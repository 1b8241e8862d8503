"""tools/peer_bench.py without llama.cpp: a missing llama_cpp or a crashed build is one
warning naming the build flags that work here, and the table still shows kvrun."""
import importlib.util
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

spec = importlib.util.spec_from_file_location(
    "peer_bench", Path(__file__).resolve().parents[1] / "tools" / "peer_bench.py")
peer_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer_bench)

ARGS = SimpleNamespace(gguf="x.gguf", peer_kv=["f16"], p=8, n=2, depths=[0], threads=1, seed=0)


@pytest.mark.parametrize("rc,stderr,want", [
    (1, "ModuleNotFoundError: No module named 'llama_cpp'", "llama_cpp is not installed"),
    (-4, "", "llama.cpp crashed (signal 4)"),
])
def test_a_peer_that_cannot_run_names_the_build_flags(monkeypatch, rc, stderr, want):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(
        returncode=rc, stderr=stderr, stdout=""))
    why = peer_bench.run_peer(ARGS)
    assert isinstance(why, str) and why.startswith(want)
    assert "-DGGML_AVX_VNNI=OFF" in why and "-DGGML_AMX_TILE=OFF" in why


def test_build_flags_follow_the_cpu():
    """An AVX2-only CPU must not be told to build llama.cpp with AVX-512 (it would fault)."""
    avx2 = peer_bench.build_command({"avx", "avx2", "fma", "f16c"})
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2
    zen4 = peer_bench.build_command({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni",
                                     "avx512_bf16"})
    assert "-DGGML_AVX512=ON" in zen4 and "-DGGML_AVX512_VNNI=ON" in zen4
    assert "-DGGML_AVX_VNNI=OFF" in zen4 and "-DGGML_AMX_TILE=OFF" in zen4


def test_table_has_both_runtimes_and_medians():
    a = SimpleNamespace(peer_kv=["f16"], kv_labels=["kivi-4"], p=8, n=2, depths=[0, 64])
    recs = [{"who": "llama.cpp", "kv": "f16", "test": "tg", "depth": 0, "ms": x} for x in (5, 7, 6)]
    recs += [{"who": "kvrun", "kv": "kivi-4", "test": "tg", "depth": 0, "ms": 4.0},
             {"who": "kvrun", "kv": "kivi-4", "test": "pp", "depth": 0, "tok_s": 100.0}]
    t = peer_bench.table(recs, a, {("kvrun", "kivi-4"): 2**20})
    assert "| tg2 @ 0 ms/tok | 6.0 (5.0–7.0) | 4.0 |" in t
    assert "| tg2 @ 64 ms/tok | – | – |" in t and "| KV MiB @ ctx | 0.0 | 1.0 |" in t


def test_unknown_peer_kv_type_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        peer_bench.main(["--peer-kv", "q3_z", "-r", "1"])
    assert e.value.code == 2 and "unknown llama.cpp KV type 'q3_z'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,msg", [(["-d", "x"], "-d: expected a comma list of depths"),
                                      (["-r", "0"], "-r and -t >= 1")])
def test_bad_flags_are_one_usage_line(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        peer_bench.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "Traceback" not in err
