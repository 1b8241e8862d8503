"""Codecs: packing is lossless, quantization stays within the RTN bound, the folded read path
equals attention over the explicitly dequantized tail, and byte formulas are exact."""
import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels import nibble
from kvrun.kernels.codecs import KEY_ONLY, METHODS, make_codec
from kvrun.kernels.quant import (asym_params, dequantize_asym, pack_codes, quantize_asym,
                                 unpack_codes)

Hkv, D, G = 3, 64, 32


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    c = torch.randint(0, 2 ** bits, (2, 96, D), dtype=torch.uint8)
    words = pack_codes(c, bits, G)
    assert words.dtype == torch.int32 and words.numel() * 4 == c.numel() * bits // 8
    assert torch.equal(unpack_codes(words, bits, G), c.float())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_rtn_error_bound(bits):
    x = torch.randn(5, 37, 64) * torch.logspace(-2, 1, 64)
    scale, zero = asym_params(x, -1, bits)
    xh = dequantize_asym(quantize_asym(x, scale, zero, bits), scale, zero)
    assert ((x - xh).abs() <= scale.float() / 2 * 1.001 + 1e-5).all()


def _packed(method, role, n=96, s0=32, S=160, seed=0, **kw):
    torch.manual_seed(seed)
    c = make_codec(method, role, G, **kw)
    st = c.alloc(Hkv, D, S)
    x = torch.randn(Hkv, n, D) * (1 + 3 * torch.rand(D))            # channel-varying ranges
    x[:, :, 5] += 6.0                                                 # an outlier channel
    rec = c.pack(st, x, s0)
    return c, st, x, rec


@pytest.mark.parametrize("method,role", [(m, r) for m in ("kivi-2", "kivi-4") for r in "kv"]
                         + [("kivi-3", "k")])
def test_kivi_error_within_bound(method, role):
    c, st, x, _ = _packed(method, role)
    xh = c.dequant(st, 32, 128)
    if role == "k":                                                   # per (group, channel)
        s = st["scale"][:, 1:4].float().repeat_interleave(G, 1)      # (Hkv, n, D)
    else:                                                             # per (token, channel group)
        s = st["scale"][:, 32:128].float().repeat_interleave(c.g, 2)
    assert ((x - xh).abs() <= s / 2 * 1.001 + 1e-3).all()


@pytest.mark.parametrize("method", ["tada-2", "tada-4", "tada-8"])
@pytest.mark.parametrize("mu", ["fp16", "int8"])
def test_tada_error_within_bound(method, mu):
    c, st, x, _ = _packed(method, "k", tada_mu=mu)
    xh = c.dequant(st, 32, 128)
    s = st["scale"][:, 32:128, None].float()                          # per (head, token)
    assert ((x - xh).abs() <= s / 2 * 1.001 + 2e-3).all()


def test_int8_error_within_bound():
    c, st, x, _ = _packed("int8", "v")
    xh = c.dequant(st, 32, 128)
    assert ((x - xh).abs() <= st["scale"][:, 32:128, None].float() / 2 * 1.001 + 1e-4).all()


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("role", ["k", "v"])
def test_gear_reduces_kivi_error(bits, role):
    _, _, x, kivi = _packed(f"kivi-{bits}", role)
    _, _, _, gl = _packed(f"gear-l-{bits}", role)
    _, _, _, g = _packed(f"gear-{bits}", role)
    e_kivi, e_gl, e_g = ((x - r).norm() for r in (kivi, gl, g))
    assert e_gl < e_kivi and e_g < e_gl, (e_kivi, e_gl, e_g)


def test_gear_outliers_absorb_spikes():
    """Isolated spikes widen KIVI's per-token range; GEAR keeps them aside (exactly, in fp16)
    and quantizes the rest with a narrow range."""
    torch.manual_seed(0)
    x = torch.randn(Hkv, 64, D)
    x[:, :, 7] += 40.0 * torch.sign(torch.randn(Hkv, 64))
    errs = {}
    for m in ("kivi-4", "gear-4"):
        c = make_codec(m, "v", G)
        st = c.alloc(Hkv, D, 64)
        errs[m] = (x - c.pack(st, x, 0)).abs().max()
    assert errs["gear-4"] * 4 < errs["kivi-4"], errs


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


def test_three_bit_keys_use_every_code_and_split_their_planes():
    """kivi-3 keys: all 8 levels occur, the 2-bit planes hold code & 3 and the 1-bit planes
    code >> 2 (chanpack's order), and a value role is refused (no value layout)."""
    from kvrun.kernels import chanpack
    c, st, x, _ = _packed("kivi-3", "k")
    codes = c.dequant(st, 32, 128).sub(st["zero"][:, 1:4].float().repeat_interleave(G, 1))
    codes = torch.round(codes / st["scale"][:, 1:4].float().repeat_interleave(G, 1))
    assert set(codes.unique().tolist()) == set(range(8))
    assert torch.equal(chanpack.codes(st["codes"], 32, 128, 2), codes.remainder(4))
    assert torch.equal(chanpack.codes(st["hi"], 32, 128, 1), codes.div(4, rounding_mode="floor"))
    with pytest.raises(ValueError, match="key codec"):
        make_codec("kivi-3", "v", G)


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


def test_int4_op_layout_probe_agrees_with_the_dispatch():
    """The probe says the op reads kvrun's nibble layout exactly when ATen dispatches its
    AVX-512 kernel (the layout was written for it); elsewhere the explicit path runs."""
    cap = torch.backends.cpu.get_cpu_capability()
    assert nibble.op_reads_layout() == (cap in ("AVX512", "AMX")), cap
