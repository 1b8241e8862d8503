"""kvrun.engine.sampling: SamplingParams' checks and `sample`'s filters (top-k, top-p, min-p,
the repetition penalty, a grammar's mask) on hand-made logits."""
import pytest
import torch

import kvrun
from kvrun.engine.sampling import SamplingParams, apply_repetition_penalty, sample


def test_top_k_one_is_greedy():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    p = SamplingParams(temp=1.5, top_k=1, seed=0)
    assert all(sample(logits, p, [], torch.Generator().manual_seed(s)) == 1 for s in range(20))


def test_top_p_and_min_p_cut_the_tail():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen = {sample(logits, SamplingParams(temp=1.0, top_k=0, top_p=0.7, min_p=0.0),
                   [], torch.Generator().manual_seed(s)) for s in range(200)}
    assert seen == {0, 1}                        # 0.5 + 0.3 crosses 0.7: two tokens kept
    seen = {sample(logits, SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.5),
                   [], torch.Generator().manual_seed(s)) for s in range(200)}
    assert seen == {0, 1}                        # min_p 0.5 × 0.5 = 0.25 keeps 0.5 and 0.3


def test_repetition_penalty():
    out = apply_repetition_penalty(torch.tensor([2.0, -2.0, 1.0]), [0, 1], 2.0)
    torch.testing.assert_close(out, torch.tensor([1.0, -4.0, 1.0]))


@pytest.mark.parametrize("bad", [dict(temp=-1), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(min_p=1.0), dict(top_k=-3), dict(repeat_penalty=0),
                                 # NaN passes every `<` check; a seed past 64 bits raised
                                 # inside the sampler (and killed a server's batch)
                                 dict(temp=float("nan")), dict(repeat_penalty=float("nan")),
                                 dict(top_p=float("nan")), dict(min_p=float("nan")),
                                 dict(temp=float("inf")), dict(seed=1 << 64), dict(seed=-1),
                                 dict(seed=1180591620717411303424), dict(repeat_last_n=-1),
                                 dict(temp="0.5"), dict(top_k=2.5), dict(seed=True)])
def test_bad_sampling_values(bad):
    with pytest.raises(kvrun.KvrunError):
        SamplingParams(**bad)


# -- a grammar's mask of allowed tokens (runtime/engine/grammar.py gives it) -------------------
@pytest.mark.parametrize("temp,top_k,penalty", [(0.0, 0, 1.0), (1.5, 0, 1.0), (0.7, 5, 1.0),
                                                (1.0, 0, 1e-30), (1.0, 40, 1e30)])
def test_sample_draws_only_allowed_tokens(temp, top_k, penalty):
    V = 301
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g) * 4
    allowed = torch.rand(V, generator=g) < 0.1
    allowed[int(torch.argmax(logits))] = False             # the best token is forbidden
    history = torch.nonzero(~allowed)[:64, 0].tolist()      # a penalty on forbidden ones
    p = SamplingParams(temp=temp, top_k=top_k, top_p=0.95, min_p=0.0, repeat_penalty=penalty,
                       seed=1)
    gen = torch.Generator().manual_seed(1)
    got = {sample(logits, p, history, gen, allowed) for _ in range(300)}
    assert got and all(allowed[t] for t in got)
    if temp == 0:
        assert got == {int(torch.argmax(logits.masked_fill(~allowed, float("-inf"))))}
    else:
        assert len(got) > 1
