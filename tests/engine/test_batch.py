"""Batched decoding (runtime/engine/batch.py, runtime/engine/scheduler.py, Model.generate_batch): every
sequence of a batch decodes exactly as it does alone, on the real default model (int4, the
native step) across KV methods and window flushes, and on the tiny fp32 model (the eager
fallback); admission under a budget, the queue, cancellation."""
from __future__ import annotations

import threading

import pytest
import torch

import kvrun
from kvrun.model import llama as llama_mod
from kvrun.errors import KvrunError
from kvrun.engine.sampling import SamplingParams
from kvrun.engine.scheduler import QueueFull, Scheduler

STORY = "The history of the old harbour town is long, and its people remember every storm. "
PROMPTS = ["The capital of France is",                     # 5 tokens
           STORY * 11,                                      # ~200: flushes during prefill and decode
           "1, 2, 3, 4,",
           STORY * 8 + "In short,",                         # ~150: the window flushes while decoding
           "def fib(n):\n    "]
N = 64


def fresh(m):
    """`m` with an empty cache: a batch prefills every prompt from scratch, and generate()
    after another prompt could resume from its cached prefix (the last prompt token then
    runs as a decode step, whose logits differ from a prefill chunk's in the last bits)."""
    m.reset()
    return m


@pytest.fixture(scope="module")
def smol():
    from kvrun.engine.pull import ensure_default_model
    return kvrun.load(ensure_default_model(progress=None), ctx=1024, kv="fp16")


@pytest.fixture(scope="module")
def alone(smol):
    """Greedy continuations of PROMPTS, one at a time through generate(), per KV method."""
    out = {}

    def get(kv: str, n: int = N) -> list[str]:
        if (kv, n) not in out:
            m = kvrun.load(smol.path, ctx=1024, kv=kv)
            out[kv, n] = [fresh(m).generate(p, n, temp=0) for p in PROMPTS]
        return out[kv, n]
    return get


@pytest.mark.parametrize("kv", ["fp16", "kivi-4", "auto"])
def test_generate_batch_equals_alone(smol, alone, kv):
    ref = alone(kv)
    n = sorted(len(smol.tokenize(p)) for p in PROMPTS)
    assert n[-2] < 128 + 32 and n[-2] + N > 128 + 64            # a window flushes while decoding
    assert smol.generate_batch(PROMPTS, N, temp=0, kv=kv) == ref
    # two at a time: sequences join and leave between steps, in a different company
    assert smol.generate_batch(PROMPTS, N, temp=0, kv=kv, parallel=2) == ref


def test_prefill_chunks_interleave_and_groups(smol, alone, monkeypatch):
    """Small prefill chunks (a long prompt is read over many steps while others decode) and
    more rows than one native call takes (groups of MAX_ROWS) change nothing."""
    ref = alone("kivi-4")
    monkeypatch.setattr(llama_mod, "MAX_ROWS", 2)             # Transformer.decode_rows' groups
    m = kvrun.load(smol.path, ctx=1024, kv="kivi-4", prefill_chunk=32)
    assert m.generate_batch(PROMPTS, N, temp=0) == ref


def test_methods_mix_in_one_batch(smol, alone):
    """Each request's cache has its own KV method; one batch mixes them."""
    kvs = ["fp16", "kivi-4", "auto", "int8", "kivi-4"]
    sched = Scheduler(smol, parallel=8, kv="fp16")
    reqs = [sched.submit(smol.tokenize(p), N, SamplingParams(temp=0), kv=kv)
            for p, kv in zip(PROMPTS, kvs)]
    sched.run()
    for i, (r, kv) in enumerate(zip(reqs, kvs)):
        assert r.finish_reason in ("stop", "length")
        assert r.text == alone(kv)[i], (i, kv)


def test_rows_bit_identical(smol):
    """The native step's rows: row b of a B-row call equals a one-row call (every B, both
    weight kinds: int4 layers and the int8 lm_head)."""
    T = smol.transformer
    from kvrun.kv.build import make_cache
    c = make_cache(smol.cfg, 8, "fp16")
    step = T.native_step(torch.tensor([[1]]), c)
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(9, smol.cfg.hidden_size, generator=g)
    with torch.inference_mode():
        step.scratch.cos[:] = step.scratch.cos[0]                # one position for every row
        step.scratch.sin[:] = step.scratch.sin[0]
        single = []
        for b in range(9):
            step.scratch.x[:1] = xs[b]
            step.plans[0].pre(1, 2)
            pre = step.scratch.qkv[0].clone()
            single.append((pre, step.plans[-1].logits(1, step.norm, step.head, 2)[0].clone()))
        for B in (2, 3, 4, 5, 9):
            step.scratch.x[:B] = xs[:B]
            step.plans[0].pre(B, 2)
            logits = step.plans[-1].logits(B, step.norm, step.head, 2)
            for b in range(B):
                assert torch.equal(step.scratch.qkv[b], single[b][0]), (B, b)
                assert torch.equal(logits[b], single[b][1]), (B, b)


def test_stop_and_seed_per_request(smol):
    p = "Write a list of fruits:\n1."
    ref = fresh(smol).generate(p, 40, temp=0, stop="\n3")
    assert smol.generate_batch([p, "Hello"], 40, temp=0, stop="\n3")[0] == ref
    sampled = fresh(smol).generate(p, 30, temp=0.8, seed=7)
    assert smol.generate_batch([p, p], 30, temp=0.8, seed=7) == [sampled, sampled]


def test_eager_fallback_tiny(tiny):
    """fp32 weights: no native step; rows run one by one through the model's forward."""
    prompts = [[1, 5, 9], list(range(3, 60)), [7] * 20]
    ref = [fresh(tiny).generate(p, 30, temp=0) for p in prompts]
    assert tiny.generate_batch(prompts, 30, temp=0, kv="fp32") == ref
    assert tiny.generate_batch(prompts, 30, temp=0, kv="fp32", parallel=1) == ref


def test_admission_budget_and_queue(tiny):
    sched = Scheduler(tiny, parallel=8, kv="fp32", max_queue=3, ctx=128)
    _, n_ctx, nbytes = sched.plan(10, 20, sched.kv)
    assert n_ctx == 30
    budget = 2.5 * nbytes / (1 << 20)                      # two such caches fit, not three
    sched = Scheduler(tiny, parallel=8, kv="fp32", kv_budget_mb=budget, max_queue=3, ctx=128)
    # the queue holds 3 beyond the 8 free slots
    reqs = [sched.submit(list(range(1, 11)), 20, SamplingParams(temp=0)) for _ in range(11)]
    with pytest.raises(QueueFull):
        sched.submit([1, 2, 3], 20)
    sched.step()
    assert len(sched.running) == 2 and len(sched.pending) == 9
    assert sched.kv_used == 2 * nbytes
    peak = 0
    while sched.step():
        peak = max(peak, len(sched.running))
        assert sched.kv_used <= budget * (1 << 20)
    assert peak <= 2 and all(r.finish_reason == "length" for r in reqs)
    assert sched.kv_used == 0
    with pytest.raises(KvrunError, match="prompt too long"):
        sched.submit(list(range(1, 129)), 1)
    with pytest.raises(KvrunError, match="more than the whole budget"):
        sched.submit([1, 2], 120)
    with pytest.raises(KvrunError, match="max_tokens"):
        sched.submit([1, 2], -1)


def test_cancel_frees_the_slot(tiny):
    sched = Scheduler(tiny, parallel=2, kv="fp32", ctx=256).start()
    try:
        req = sched.submit([1, 2, 3], 200, SamplingParams(temp=0))
        events = req.events(timeout=30)
        first = [next(events) for _ in range(3)]
        assert all(ev.token_id is not None for ev in first)
        events.close()                                      # a client gone
        assert req.result(timeout=30) is not None and req.finish_reason == "cancelled"
        assert req.n_tokens < 200
        done = threading.Event()
        for _ in range(300):
            if not sched.busy():
                done.set()
                break
            threading.Event().wait(0.01)
        assert done.is_set() and sched.kv_used == 0
        # the loop still serves
        r2 = sched.submit([4, 5], 5, SamplingParams(temp=0))
        assert r2.result(timeout=30) == fresh(tiny).generate([4, 5], 5, temp=0)
    finally:
        sched.shutdown(timeout=30)


# -- generate_batch fails as generate does, and holds its caches under a bound (issue 56) -------

def test_generate_batch_raises_for_the_prompt_that_failed(tiny, monkeypatch):
    """A sequence that failed came back as '' (generate raises for the same input)."""
    from kvrun.engine import batch as B
    real = B.Sequence.prefill_next

    def boom(self):
        if self.prompt[:3] == [7, 8, 9]:
            raise KvrunError("boom")
        return real(self)
    monkeypatch.setattr(B.Sequence, "prefill_next", boom)
    with pytest.raises(KvrunError, match="^prompt 1: boom$"):
        tiny.generate_batch([[5, 6, 7], [7, 8, 9, 10], [3, 4]], 3, temp=0)
    with pytest.raises(KvrunError, match="^prompt 2: prompt too long"):
        tiny.generate_batch([[5], [6], [1] * 300], 3)


def test_generate_batch_holds_caches_under_a_bound(tiny, monkeypatch):
    """Every prompt's cache was allocated at once (1000 x 128 tokens: 7.2 GB); by default
    the caches held at once now stay under api.BATCH_KV_MB (here: one prompt's worth)."""
    from kvrun.engine import api
    from kvrun.engine.scheduler import Scheduler
    monkeypatch.setattr(api, "BATCH_KV_MB", 1e-6)
    most = []
    real = Scheduler._admit

    def admit(self):
        real(self)
        most.append(len(self.running))
    monkeypatch.setattr(Scheduler, "_admit", admit)
    prompts = [[5 + i, 6, 7] for i in range(12)]
    got = tiny.generate_batch(prompts, 3, temp=0)
    assert max(most) == 1
    assert got == [tiny.generate(p, 3, temp=0) for p in prompts]
