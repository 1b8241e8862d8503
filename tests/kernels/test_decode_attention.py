"""decode_attention (torch path) equals dense causal attention over the explicitly
dequantized tail + window + new tokens, for every codec, GQA ratio and window fill.

The fp16 tail is read in fp32 (exact up to fp32 rounding: this catches block, merge and
masking bugs to 2e-5); the packed codecs multiply in bf16 (nibble.py), so their scores carry
a relative 2^-9 rounding and the outputs are compared at bf16-attention tolerance — their
element-wise exactness against the dequantization is tested in test_codecs.py."""
import pytest
from torch.testing import assert_close

from attention_cases import attention_case, dequantized_reference
from kvrun.kernels import decode_attention

D, G = 64, 32

# (n_tail, window, new): totals 1, 31, 33, 200, 517 and a chunked prefill on a tail
CASES = [(0, 0, 1), (0, 30, 1), (32, 0, 1), (160, 35, 5), (480, 32, 5), (96, 17, 70)]


def _setup(k_method, v_method, Hkv, n_tail, W, T, Gq, **kw):
    return attention_case(k_method, v_method, Hkv, Gq, D, n_tail, W, T, G=G, **kw)


def _tol(method):
    return dict(atol=2e-5, rtol=1e-4) if method in ("fp16", "bf16") else dict(atol=5e-2, rtol=0)


METHOD_GQA = ([(m, 3) for m in ("fp16", "int8", "kivi-2", "kivi-4", "tada-2", "tada-4", "tada-8",
                                 "gear-l", "gear-2")]
              + [(m, g) for m in ("kivi-2", "tada-4", "gear") for g in (1, 8)])


@pytest.mark.parametrize("method,Gq", METHOD_GQA)
@pytest.mark.parametrize("case", CASES)
def test_matches_dequantized_reference(method, Gq, case):
    n_tail, W, T = case
    args = _setup(method, method, 2, n_tail, W, T, Gq)
    ref = dequantized_reference(*args[:3], n_tail, *args[3:])
    q, kt, vt, kw, vw, kn, vn = args
    out = decode_attention(q, kt, vt, n_tail, kw, vw, kn, vn, block=64, q_chunk=32)
    assert out.shape == q.shape
    assert_close(out, ref, **_tol(method if n_tail else "fp16"))


@pytest.mark.parametrize("kv", [("kivi-4", "kivi-2"), ("tada-4", "fp16"), ("int8", "gear"),
                                ("tada-2", "tada-8"), ("kivi-3", "kivi-2"), ("kivi-3", "cb-3")])
def test_mixed_k_v_codecs_and_int8_mean(kv):
    args = _setup(*kv, 3, 224, 40, 3, 3, tada_mu="int8")
    ref = dequantized_reference(*args[:3], 224, *args[3:])
    q, kt, vt, kw, vw, kn, vn = args
    assert_close(decode_attention(q, kt, vt, 224, kw, vw, kn, vn, block=96), ref, **_tol(kv[0]))


def test_block_size_does_not_change_the_result():
    q, kt, vt, kw, vw, kn, vn = _setup("kivi-2", "kivi-2", 3, 512, 10, 1, 3)
    a = decode_attention(q, kt, vt, 512, kw, vw, kn, vn, block=32)
    b = decode_attention(q, kt, vt, 512, kw, vw, kn, vn, block=4096)
    assert_close(a, b, atol=1e-2, rtol=0)           # bf16 rounding of each block's products


def test_new_tokens_are_causal():
    """Changing a later new token must not change an earlier query's output."""
    q, kt, vt, kw, vw, kn, vn = _setup("tada-4", "tada-4", 2, 64, 8, 6, 3)
    a = decode_attention(q, kt, vt, 64, kw, vw, kn, vn)
    kn2, vn2 = kn.clone(), vn.clone()
    kn2[:, :, 4:] += 5.0
    vn2[:, :, 4:] -= 3.0
    b = decode_attention(q, kt, vt, 64, kw, vw, kn2, vn2)
    assert_close(a[:, :, :4], b[:, :, :4], atol=1e-6, rtol=0)
    assert (a[:, :, 4:] - b[:, :, 4:]).abs().max() > 1e-2
