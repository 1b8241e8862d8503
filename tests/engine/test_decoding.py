"""One generation's bookkeeping (runtime/engine/decoding.py), which single and batched
decoding share: the finish checks in their order (stop token, then max_tokens, then a full
context that cannot shift), the history sampling's repetition penalty reads, and a seeded
generator that repeats a sampled sequence."""
from types import SimpleNamespace

import pytest
import torch

from kvrun.engine.decoding import Decoding
from kvrun.engine.sampling import SamplingParams

V = 16


def peaked(tok: int) -> torch.Tensor:
    x = torch.zeros(V)
    x[tok] = 10.0
    return x


def engine(cached: int, max_ctx: int = 100, can_shift: bool = False):
    return SimpleNamespace(cached=[0] * cached, max_ctx=max_ctx, can_shift=can_shift)


def test_the_finish_checks_in_their_order():
    d = Decoding([1, 2], max_tokens=2, params=SamplingParams(temp=0), stop_ids={5})
    assert d.sample(peaked(3)) == 3 and d.finish_reason(3, engine(3)) is None
    assert d.history == [1, 2, 3] and d.n == 1
    assert d.sample(peaked(5)) == 5
    assert d.finish_reason(5, engine(100)) == "stop"          # before length and context
    d = Decoding([], max_tokens=1, params=SamplingParams(temp=0), stop_ids=set())
    assert d.finish_reason(d.sample(peaked(4)), engine(100)) == "length"   # before context


@pytest.mark.parametrize("can_shift,want", [(False, "context"), (True, None)])
def test_a_full_context_ends_unless_it_shifts(can_shift, want):
    d = Decoding([0], max_tokens=10, params=SamplingParams(temp=0), stop_ids=set())
    assert d.finish_reason(d.sample(peaked(7)), engine(50, max_ctx=50, can_shift=can_shift)) == want


def test_the_history_feeds_the_repetition_penalty():
    """The prompt and every sampled token are in the history: a penalty of 100 on a token
    already there lets the runner-up win."""
    logits = peaked(3)
    logits[4] = 9.0
    params = SamplingParams(temp=0, repeat_penalty=100.0)
    d = Decoding([3], 4, params, set())
    assert d.sample(logits) == 4                              # 3 is in the prompt
    d = Decoding([0], 4, params, set())
    assert d.sample(peaked(3)) == 3 and d.sample(logits) == 4  # 3 was just sampled


def test_a_seed_repeats_the_sampled_tokens():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(V, generator=g) for _ in range(12)]
    runs = []
    for _ in range(2):
        d = Decoding([], 12, SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7), set())
        runs.append([d.sample(r) for r in rows])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1
