"""A decode step gives the same bits on 1 and 2 threads: the native attention cuts a cache
into token splits by its length, never by the thread count, and sums their partial outputs
in split order (decode_attention.c, ring_attention.c); the GEMVs compute each output row in
one thread. Without this a greedy continuation on the integer GEMVs depended on how many
threads the governor (runtime/threads.py) granted that step."""
import copy

import pytest
import torch

import kvrun
from kvrun import threads
from kvrun.kernels import native
from tiny import make_tiny_model_dir, quantized_copy

pytestmark = pytest.mark.skipif(native.load() is None, reason="the native kernels did not build")


def _steps(m, cache, tokens, nth):
    """Logits of decode steps feeding `tokens` on nth threads, from a copy of `cache`."""
    m.engine.cache = copy.deepcopy(cache)
    threads.configure(nth)
    return torch.stack([m.engine.decode_step(t).float().reshape(-1) for t in tokens])


@pytest.mark.parametrize("gemv", ["fp32", "int"])
@pytest.mark.parametrize("arch,kv,n", [("llama", "fp16", 700), ("llama", "kivi-4", 1100),
                                       ("llama", "int8", 333), ("llama", "cb-4", 500),
                                       ("gemma3", "kivi-4", 900)])
def test_decode_steps_are_the_same_bits_on_one_and_two_threads(tmp_path, monkeypatch, arch, kv, n,
                                                               gemv):
    monkeypatch.setenv("KVRUN_GEMV", gemv)
    monkeypatch.setattr(threads.governor, "adapt", False)        # exactly the count asked
    extra = dict(sliding_window=300) if arch == "gemma3" else {}   # a ring of two splits
    src = make_tiny_model_dir(tmp_path / "m", architecture=arch, hidden_size=128, num_heads=4,
                              intermediate_size=96, max_position=2048, **extra)
    m = kvrun.load(quantized_copy(src, tmp_path / "q", "int4"), ctx=2048, kv=kv, threads=2)
    assert getattr(m.transformer, "native_step", None) is not None
    g = torch.Generator().manual_seed(n)
    m.engine.prefill(torch.randint(3, 250, (n,), generator=g).tolist())
    cache = m.engine.cache
    tokens = torch.randint(3, 250, (6,), generator=g).tolist()
    cap = threads.governor.cap
    try:
        one, two = _steps(m, cache, tokens, 1), _steps(m, cache, tokens, 2)
    finally:
        threads.configure(cap)
    assert torch.isfinite(one).all()
    assert torch.equal(one, two), (one - two).abs().max()
