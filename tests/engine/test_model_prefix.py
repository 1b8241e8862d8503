"""A library Model keeps a compressed prefix across calls (runtime/engine/model_prefix.py):
prompts that share a system prompt, alternating, resume from its chunk-boundary state with
a compressed cache (where the engine's own reuse re-prefills from 0), and every output
equals the cold one; the bound is load(cache_ram_mb=), 0 turns it off."""
import pytest
import torch

import kvrun
from kvrun.engine.generate import Timings
from kvrun.engine.model_prefix import ModelPrefix
from kvrun.engine.prefix_budget import MODEL_CAP_MB, model_default_mb
from kvrun.engine.sampling import SamplingParams
from kvrun.errors import KvrunError
from kvrun.kv.config import parse_kv
from tiny import make_tiny_model_dir

GREEDY = SamplingParams(temp=0)
CHUNK = 48


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("mp") / "tiny", hidden_size=128)


def _ids(n, seed):
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(m, ids, n=30):
    """(greedy ids, prompt tokens prefilled)."""
    t = Timings()
    out = [tok for tok, _ in m.engine.tokens(ids, n, GREEDY, set(), t)]
    return out, t.prompt_tokens


@pytest.mark.parametrize("method", ["kivi-4", "tada-4", "fp16"])
def test_alternating_prompts_resume_from_the_shared_prefix(tiny32, method):
    kv = parse_kv(method, residual=32, group=32)
    system = _ids(200, 0)
    a, b = system + _ids(20, 1), system + _ids(25, 2)
    m = kvrun.load(tiny32, dtype="fp32", ctx=512, kv=kv, prefill_chunk=CHUNK)
    cold = kvrun.load(tiny32, dtype="fp32", ctx=512, kv=kv, prefill_chunk=CHUNK, cache_ram_mb=0)
    assert cold.prefix_cache is None

    def alone(p):
        cold.reset()
        return _run(cold, p)[0]

    runs = [(p, _run(m, p)) for p in (a, b, a, b)]
    for p, (out, _) in runs:
        assert out == alone(p)
    boundary = len(system) // CHUNK * CHUNK                  # 192: the last one inside it
    for p, (_, prefilled) in runs[1:]:
        assert prefilled <= len(p) - boundary
    st = m.prefix_cache.stats()
    assert st["bytes"] <= st["budget_bytes"]
    if method != "fp16":            # fp16: the engine's own reuse keeps the shared prefix
        assert (st["requests"], st["hits"]) == (4, 3)        # the first: a miss
        _run(cold, a)                                        # the engine alone starts over
        assert _run(cold, b)[1] == len(b)


def test_the_bound_and_off(tiny32):
    m = kvrun.load(tiny32, dtype="fp32", ctx=256, kv="fp16", prefill_chunk=CHUNK)
    assert m.prefix_cache.budget == int(model_default_mb() * (1 << 20))
    assert 0 < model_default_mb() <= MODEL_CAP_MB
    tiny = kvrun.load(tiny32, dtype="fp32", ctx=256, kv="fp16", prefill_chunk=CHUNK,
                      cache_ram_mb=0.001)                 # no snapshot fits: nothing kept
    _run(tiny, _ids(120, 3))
    assert tiny.prefix_cache.stats()["entries"] == 0
    for bad in (-1, float("nan"), "big", True):
        with pytest.raises(KvrunError, match="cache_ram_mb"):
            kvrun.load(tiny32, ctx=16, cache_ram_mb=bad)


def test_the_hooks_keep_a_boundary_and_resume_from_it(tiny32):
    """ModelPrefix on its own: a state kept at a chunk boundary is what a cold engine resumes
    from; an engine whose own reuse kept as much is left as it is."""
    kv = parse_kv("kivi-4", residual=32, group=32)
    m = kvrun.load(tiny32, dtype="fp32", ctx=256, kv=kv, prefill_chunk=CHUNK, cache_ram_mb=0)
    hooks, prompt = ModelPrefix(kv, budget_mb=64), _ids(120, 5)
    assert hooks.cache.budget == 64 << 20
    m.engine.prefill(prompt[:CHUNK])
    hooks.checkpoint(m.engine)
    assert hooks.cache.stats()["entries"] == 1
    assert hooks.resume(m.engine, prompt, have=CHUNK) == CHUNK
    m.engine.reset()
    assert hooks.resume(m.engine, prompt, have=0) == CHUNK
    assert list(m.engine.cached) == prompt[:CHUNK]
    assert hooks.resume(m.engine, _ids(120, 6), have=0) == 0         # another prompt: cold
