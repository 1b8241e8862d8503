"""tools/peer_bench.py without llama.cpp: a missing llama_cpp or a crashed build is one
warning naming the build flags that work here, and the table still shows kvrun."""
import subprocess
from types import SimpleNamespace

import pytest

from tool_module import load_tool

peer_bench = load_tool("peer_bench")

ARGS = SimpleNamespace(gguf="x.gguf", peer_kv=["f16"], p=8, n=2, depths=[0], threads=1, seed=0,
                       batches=[])


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
    a = SimpleNamespace(peer_kv=["f16"], kv_labels=["kivi-4"], p=8, n=2, depths=[0, 64], batches=[])
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


def test_batch_table_gives_aggregates_and_the_gain_over_batch_one():
    a = SimpleNamespace(peer_kv=["f16"], kv_labels=["auto"], p=0, n=4, depths=[256], batches=[1, 8])
    recs = [{"who": w, "kv": k, "test": "batch", "depth": 256, "batch": b, "tok_s": x}
            for w, k, b, x in [("llama.cpp", "f16", 1, 50.0), ("llama.cpp", "f16", 8, 100.0),
                               ("kvrun", "auto", 1, 40.0), ("kvrun", "auto", 8, 120.0),
                               ("kvrun", "auto", 8, 140.0)]]
    t = peer_bench.table(recs, a, {})
    assert "| tg4 @ 256, batch 1, aggregate tok/s | 50.0 (50.0–50.0) | 40.0 (40.0–40.0) |" in t
    assert "| tg4 @ 256, batch 8, aggregate tok/s | 100.0 (100.0–100.0, 2.00x) | 130.0 (120.0–140.0, 3.25x) |" in t


def test_kvrun_batch_records_come_from_bench_batch(tiny_dir):
    import kvrun
    from kvrun.kv.config import parse_kv
    m = kvrun.load(tiny_dir, ctx=128)
    a = SimpleNamespace(n=2, depths=[70], batches=[1, 3], seed=0)
    recs = peer_bench.run_kvrun(m, [parse_kv("fp16"), parse_kv("int8", residual=32, group=32)], a)
    assert {(r["kv"], r["batch"]) for r in recs} == {(k, b) for k in ("fp16", "int8") for b in (1, 3)}
    assert all(r["test"] == "batch" and r["depth"] == 70 and r["tok_s"] > 0 for r in recs)


@pytest.mark.parametrize("argv,msg", [(["-d", "x"], "-d: expected a comma list of depths"),
                                      (["-r", "0"], "-r and -t >= 1"),
                                      (["--batch", "1,x"], "--batch: expected a comma list"),
                                      (["--batch", "0"], "--batch: batch sizes and -n must be >= 1"),
                                      (["--kv-budget", "1024"], "--kv-budget needs --evict"),
                                      (["--evict", "bogus", "--kv-budget", "1024"],
                                       "unknown eviction policy 'bogus'"),
                                      (["--evict", "h2o"], "--evict h2o needs --kv-budget")])
def test_bad_flags_are_one_usage_line(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        peer_bench.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "Traceback" not in err
