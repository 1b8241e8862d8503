"""Every codec at once: the folded read path equals attention over the explicitly dequantized
tail, byte formulas are exact, all-zero rows stay zero. One codec's own bounds live in its
file (test_codecs_kivi.py, test_codecs_tada.py, test_codecs_gear.py, test_codecs_base.py),
which borrow `_packed` from here."""
import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels import nibble
from kvrun.kernels.codecs import KEY_ONLY, METHODS, make_codec

Hkv, D, G = 3, 64, 32


def _packed(method, role, n=96, s0=32, S=160, seed=0, **kw):
    torch.manual_seed(seed)
    c = make_codec(method, role, G, **kw)
    st = c.alloc(Hkv, D, S)
    x = torch.randn(Hkv, n, D) * (1 + 3 * torch.rand(D))            # channel-varying ranges
    x[:, :, 5] += 6.0                                                 # an outlier channel
    rec = c.pack(st, x, s0)
    return c, st, x, rec


def _bf16_tol(a, b):
    """Tolerance of a product a @ b computed by the packed read path: bf16 inputs and a bf16
    result (relative 2^-9 each) — 4 bf16 ulps of the largest |a| @ |b| term, plus fp32 slack."""
    return 2.0 ** -7 * (a.abs() @ b.abs()).max().item() + 1e-4


ROLES = [(m, r) for m in METHODS for r in "kv" if not (r == "v" and m in KEY_ONLY)]


@pytest.mark.parametrize("method,role", ROLES)
@pytest.mark.parametrize("span", [(32, 128), (64, 96), (96, 128)])
@pytest.mark.parametrize("explicit", [False, True])
def test_read_path_equals_dequantized(method, role, span, explicit, monkeypatch):
    """Scores / mix from the packed codes equal the product with the explicit dequantization,
    element by element (a token or channel out of place is an O(1) error), for spans that
    start and end inside the nibble layouts' 64/128-token blocks."""
    s0, s1 = span
    if explicit:             # the path CPUs whose int4 op reads another nibble layout take
        monkeypatch.setattr(nibble, "_READS_LAYOUT", False)
    c, st, x, rec = _packed(method, role)
    xh = c.dequant(st, s0, s1)
    assert_close(rec[:, s0 - 32:s1 - 32], xh, atol=1e-3, rtol=1e-3)   # pack returns what is stored
    torch.manual_seed(1)
    if role == "k":
        qg = torch.randn(Hkv, 7, D)
        ref = qg @ xh.transpose(1, 2)
        assert_close(c.scores(st, qg, s0, s1), ref, atol=_bf16_tol(qg, xh.transpose(1, 2)), rtol=0)
    else:
        p = torch.rand(Hkv, 7, s1 - s0)
        assert_close(c.mix(st, p, s0, s1), p @ xh, atol=_bf16_tol(p, xh), rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_bytes_per_token_is_exact(method):
    for role in "k" if method in KEY_ONLY else "kv":
        c = make_codec(method, role, G, tada_mu="int8")
        S = 8 * G                           # whole 128-token blocks of the nibble layouts
        allocated = sum(t.nbytes for t in c.alloc(Hkv, D, S).values())
        assert sum(c.bytes_per_token(Hkv, D).values()) * S == allocated


def test_known_sizes():
    # kivi-4 K per token-head: 32 B codes + (2+2 B) * 64 channels / 32 tokens = 40 B
    assert sum(make_codec("kivi-4", "k", 32).bytes_per_token(1, 64).values()) == 40
    # kivi-3 K: 24 B codes (16 in 2-bit planes, 8 in 1-bit planes) + the same 8 B of scales
    assert sum(make_codec("kivi-3", "k", 32).bytes_per_token(1, 64).values()) == 32
    # kivi-2 V, g=32: 16 B codes + 2 groups * 4 B = 24 B
    assert sum(make_codec("kivi-2", "v", 32, v_group=32).bytes_per_token(1, 64).values()) == 24
    # tada-4, 3 heads, fp16 mean: 3 * (32 + 4) + 128 B of mean
    assert sum(make_codec("tada-4", "k", 32).bytes_per_token(3, 64).values()) == 3 * 36 + 128


@pytest.mark.parametrize("method,kw", [("int8", {}), ("tada-4", {"tada_mu": "int8"})])
def test_all_zero_rows_stay_zero(method, kw):
    """A symmetric int8 scale floor of 1e-8 rounded to 0 in fp16: an all-zero row (or
    mean) got scale 0 and NaN codes. The floor is now the smallest fp16, 2^-24."""
    from kvrun.kernels import make_codec
    for role in ("k", "v"):
        c = make_codec(method, role, 32, **kw)
        st = c.alloc(2, 64, 64)
        c.pack(st, torch.zeros(2, 32, 64), 0)
        assert torch.equal(c.dequant(st, 0, 32), torch.zeros(2, 32, 64))


