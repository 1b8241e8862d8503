"""The serving loop's isolation and queue (runtime/engine/scheduler.py, runtime/engine/batch.py) on the tiny
model: a request whose values fail inside the loop (its seed, its sampling, its row of the
forward) ends alone with finish reason "error" while the others decode exactly as they do
alone; `max_queue` counts the requests waiting beyond the free slots."""
from __future__ import annotations

import pytest

import kvrun
from kvrun.engine import batch as batch_mod
from kvrun.engine.sampling import SamplingParams
from kvrun.engine.scheduler import QueueFull, Scheduler

GOOD = [list(range(3, 40)), [5, 9, 11, 7]]
N = 24


@pytest.fixture(scope="module")
def tiny_m(tiny_dir):
    return kvrun.load(tiny_dir, dtype="fp32", ctx=256, kv="fp32")


def alone(m, prompt):
    sched = Scheduler(m, parallel=1, kv="fp32", ctx=128)
    r = sched.submit(prompt, N, SamplingParams(temp=0))
    sched.run()
    return r.text


def slipped(**bad) -> SamplingParams:
    """Params whose values passed validation, then changed: what the loop must survive even
    if a check is ever missed."""
    p = SamplingParams(temp=0.7, seed=1)
    for k, v in bad.items():
        setattr(p, k, v)
    return p


@pytest.mark.parametrize("bad", [{"temp": float("nan")}, {"repeat_penalty": float("nan")},
                                 {"seed": 1 << 70}, {"top_k": "many"}])
def test_bad_request_fails_alone(tiny_m, bad):
    refs = [alone(tiny_m, p) for p in GOOD]
    sched = Scheduler(tiny_m, parallel=4, kv="fp32", ctx=128).start()
    try:
        good = [sched.submit(p, N, SamplingParams(temp=0)) for p in GOOD]
        wrong = sched.submit([4, 5, 6], N, slipped(**bad))
        assert wrong.result(timeout=30) == "" and wrong.finish_reason == "error"
        assert wrong.error
        assert [r.result(timeout=30) for r in good] == refs
        assert all(r.finish_reason == "length" for r in good)
        later = sched.submit(GOOD[1], N, SamplingParams(temp=0))      # the loop still serves
        assert later.result(timeout=30) == refs[1]
    finally:
        sched.shutdown(timeout=30)
    assert not sched._thread.is_alive()


def test_forward_failure_fails_only_its_row(tiny_m, monkeypatch):
    refs = [alone(tiny_m, p) for p in GOOD]
    real = batch_mod.batch_forward
    doomed, calls = [], []

    def flaky(model, tokens, caches):
        if doomed and any(c is doomed[0] for c in caches):
            calls.append(len(caches))
            raise RuntimeError("row 1 went wrong")
        return real(model, tokens, caches)
    monkeypatch.setattr(batch_mod, "batch_forward", flaky)
    sched = Scheduler(tiny_m, parallel=4, kv="fp32", ctx=128)
    reqs = [sched.submit(p, N, SamplingParams(temp=0)) for p in [GOOD[0], [4, 5, 6], GOOD[1]]]
    sched.step()
    doomed.append(reqs[1].seq.cache)
    sched.run()
    assert reqs[1].finish_reason == "error" and "row 1 went wrong" in reqs[1].error
    assert calls[0] > 1                                 # it failed inside a batch of rows
    assert [reqs[0].text, reqs[2].text] == refs
    assert sched.kv_used == 0


def test_queue_counts_beyond_the_slots(tiny_m):
    sched = Scheduler(tiny_m, parallel=1, kv="fp32", ctx=128, max_queue=0)
    r = sched.submit([4, 5], 2, SamplingParams(temp=0))           # idle: served, not 429
    with pytest.raises(QueueFull):
        sched.submit([4, 5], 2)
    sched.run()
    assert r.finish_reason in ("length", "stop")
    sched = Scheduler(tiny_m, parallel=4, kv="fp32", ctx=128, max_queue=4)
    taken, refused = [], 0
    for i in range(32):                                             # a burst
        try:
            taken.append(sched.submit([4, 5, i + 3], 2))
        except QueueFull:
            refused += 1
        if i == 2:
            sched.step()                                            # 3 admitted mid-burst
    assert (len(taken), refused) == (8, 24)
    sched.run()
    assert all(r.finish_reason in ("length", "stop") for r in taken)


def test_close_then_cancel_all(tiny_m):
    from kvrun.engine.scheduler import SHUTTING_DOWN, Closed
    sched = Scheduler(tiny_m, parallel=1, kv="fp32", ctx=128)
    running = sched.submit(GOOD[0], 50, SamplingParams(temp=0))      # no stop token in 50
    waiting = sched.submit(GOOD[0], 50, SamplingParams(temp=0))
    sched.step()
    sched.close()
    with pytest.raises(Closed):
        sched.submit([4, 5], 2)
    sched.step()
    sched.cancel_all(SHUTTING_DOWN)
    sched.run()
    assert [(r.finish_reason, r.error) for r in (running, waiting)] == [("error", SHUTTING_DOWN)] * 2
    assert 0 < running.n_tokens < 50 and waiting.n_tokens == 0 and sched.kv_used == 0
