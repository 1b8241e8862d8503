"""decode_attention's optional `mass` output equals the explicit softmax probabilities of a
dense reference over the dequantized tail + window + new tokens, summed over the queries
t >= mass_from (per query head), and leaves the attention output unchanged."""
import pytest
import torch
from torch.testing import assert_close

from attention_cases import attention_case
from kvrun.kernels import decode_attention

D, G = 32, 32


def _setup(method, Hkv, Gq, n_tail, W, T):
    return attention_case(method, method, Hkv, Gq, D, n_tail, W, T, G=G)


def _reference_probs(q, kt, vt, n_tail, kw, vw, kn):
    """(H, T, n_tail + W + T) causal softmax probabilities, GQA by repeat_interleave."""
    (kc, ks) = kt
    H, T, Hkv = q.shape[1], q.shape[2], kn.shape[1]
    kd = kc.dequant(ks, 0, n_tail) if n_tail else kn[0, :, :0]
    K = torch.cat([kd, kw[0].float(), kn[0]], 1).repeat_interleave(H // Hkv, 0)  # (H, S, D)
    sc = q[0] @ K.transpose(1, 2) * D ** -0.5                                       # (H, T, S)
    S = K.shape[1]
    hidden = torch.arange(S)[None] > (S - T + torch.arange(T))[:, None]             # (T, S)
    return sc.masked_fill(hidden, float("-inf")).softmax(-1)


@pytest.mark.parametrize("method", ["fp16", "kivi-4", "tada-4"])
@pytest.mark.parametrize("case", [(0, 0, 1, 0), (64, 10, 1, 0), (128, 33, 7, 0),
                                  (96, 20, 70, 50), (64, 5, 40, 39), (32, 0, 9, 9)])
def test_mass_matches_softmax(method, case):
    n_tail, W, T, mass_from = case
    Hkv, Gq = 2, 3
    q, kt, vt, kw, vw, kn, vn = _setup(method, Hkv, Gq, n_tail, W, T)
    mass = torch.zeros(Hkv * Gq, n_tail + W + T)
    out = decode_attention(q, kt, vt, n_tail, kw, vw, kn, vn, block=64, q_chunk=32,
                           mass=mass, mass_from=mass_from)
    plain = decode_attention(q, kt, vt, n_tail, kw, vw, kn, vn, block=64, q_chunk=32)
    assert torch.equal(out, plain)                   # the mass path does not change the output
    ref = _reference_probs(q, kt, vt, n_tail, kw, vw, kn)[:, mass_from:].sum(1)
    tol = dict(atol=1e-5, rtol=1e-4) if method == "fp16" else dict(atol=2e-2, rtol=0)
    assert_close(mass, ref, **tol)
    # each counted query distributes exactly probability 1
    assert_close(mass.sum(-1), torch.full((Hkv * Gq,), float(max(0, T - mass_from))),
                 atol=1e-4, rtol=1e-5)


def test_mass_accumulates():
    q, kt, vt, kw, vw, kn, vn = _setup("fp16", 1, 2, 32, 4, 1)
    mass = torch.ones(2, 37)
    decode_attention(q, kt, vt, 32, kw, vw, kn, vn, mass=mass)
    assert_close(mass.sum(-1), torch.full((2,), 38.0))


def test_mass_shape_is_checked():
    q, kt, vt, kw, vw, kn, vn = _setup("fp16", 1, 2, 32, 4, 1)
    with pytest.raises(AssertionError, match="mass"):
        decode_attention(q, kt, vt, 32, kw, vw, kn, vn, mass=torch.zeros(1, 37))
