"""The codebook codecs (cb-2/3/4, kvrun.kernels.codecs.codebook; their levels and packed
group layout: test_cbpack.py): the quantizer's scale, the torch codec (the oracle) against
explicit dequantization, and the native kernels (codebook_attention.c, codebook_portable.c)
against it — the flush byte for byte, the attention to fp32 rounding — for odd head counts,
GQA ratios, tails, windows and chunks, with AVX-512, AVX2 and plain C, plus the arena's
implied rotation and the `--kv` names."""
import ctypes

import pytest
import torch
from torch.testing import assert_close

from attention_cases import attention_case, dequantized_reference
from kvrun.errors import KvrunError
from kvrun.kernels import dispatch, native
from kvrun.kernels.codecs import make_codec, method_family
from kvrun.kernels.codecs.codebook import CodebookCodec
from kvrun.kernels.decode_attention import decode_attention as torch_attention
from kvrun.kernels.hadamard import rotation_matrix
from kvrun.kernels.native import decode_attention as nda
from kvrun.kernels.native.pack import store as native_store
from kvrun.kv.config import parse_kv

BITS = (2, 3, 4)
has_native = pytest.mark.skipif(native.load() is None, reason=f"native kernels unavailable: {native.error()}")


# -- the torch codec ------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
def test_quantize_codes_by_the_rms_and_keeps_the_projection(bits):
    """Codes are the boundaries below x / rms, so a scaled row has the same codes and a
    scale times as large; scale * (x . c) = |x|^2 (up to the fp16 scale)."""
    g = torch.Generator().manual_seed(bits)
    c = CodebookCodec("v", 32, bits)
    x = torch.randn(2, 5, 64, generator=g)
    codes, scale = c.quantize(x)
    lv, bd = c.levels(64)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    assert torch.equal(codes, torch.bucketize(x / rms, bd))
    assert_close(scale.float() * (x * lv[codes]).sum(-1), x.pow(2).sum(-1), rtol=1e-3, atol=0)
    codes2, scale2 = c.quantize(x * 4)
    assert torch.equal(codes2, codes) and torch.equal(scale2, (scale.float() * 4).half())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("role", ["k", "v"])
def test_pack_reconstructs_and_keeps_the_projection(bits, role):
    torch.manual_seed(bits)
    c = make_codec(f"cb-{bits}", role, 32)
    Hkv, n, D = 3, 96, 64
    st = c.alloc(Hkv, D, 128)
    x = torch.randn(Hkv, n, D) * torch.rand(Hkv, n, 1) * 4
    x[1, 5] = 0                                            # a zero row stays zero
    rec = c.pack(st, x, 32)
    assert_close(c.dequant(st, 32, 32 + n), rec)
    assert torch.all(rec[1, 5] == 0)
    # x̂·x = |x|² up to the fp16 scale
    assert_close((rec * x).sum(-1), (x * x).sum(-1), rtol=2e-3, atol=1e-4)
    err = ((rec - x) ** 2).sum() / (x * x).sum()
    assert err < {2: 0.15, 3: 0.045, 4: 0.013}[bits]
    assert torch.all(st["scale"][:, :32] == 0) and torch.all(st["codes"][:, :1] == 0)


@pytest.mark.parametrize("kv", ["cb-4", "cb-2/cb-3", "cb-3/cb-4"])
@pytest.mark.parametrize("geom", [(2, 3, 64, 160, 35, 1), (1, 4, 256, 64, 0, 3), (3, 1, 96, 96, 7, 1)])
def test_torch_read_path_matches_dequantized_reference(kv, geom):
    km, _, vm = kv.partition("/")
    args = attention_case(km, vm or km, *geom)
    q, kt, vt, kw, vw, kn, vn = args
    out = torch_attention(q, kt, vt, geom[3], kw, vw, kn, vn)
    assert_close(out, dequantized_reference(q, kt, vt, geom[3], kw, vw, kn, vn), atol=2e-5, rtol=1e-4)


# -- the native kernels ---------------------------------------------------------------------------
@has_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("Hkv,D,n,s0", [(3, 64, 96, 32), (1, 256, 64, 0), (5, 96, 32, 64)])
def test_native_pack_bit_identical(bits, role, Hkv, D, n, s0):
    torch.manual_seed(D + n)
    c = make_codec(f"cb-{bits}", role, 32)
    a, b = c.alloc(Hkv, D, s0 + n + 32), c.alloc(Hkv, D, s0 + n + 32)
    x = torch.randn(Hkv, n, D) * torch.rand(Hkv, n, 1) * 3 + torch.randn(D) * 0.5
    x[0, 3] = 0
    c.store(a, x, s0)
    assert native_store(c, b, x, s0)
    for name in a:
        assert torch.equal(a[name], b[name]), name


GEOMS = [(2, 3, 64, 160, 35, 1), (1, 8, 64, 96, 33, 7), (3, 1, 128, 64, 0, 1),
         (2, 3, 32, 64, 3, 2), (2, 3, 64, 0, 30, 1), (1, 4, 256, 480, 32, 70), (3, 3, 96, 224, 130, 1)]


def _check_native(km, vm, geom, dtype=torch.float32):
    Hkv, Gq, D, n_tail, W, T = geom
    q, kt, vt, kw, vw, kn, vn = attention_case(km, vm, Hkv, Gq, D, n_tail, W, T, dtype=dtype)
    # the fp32 path: KIVI keys beside a cb V have an integer path whose queries are
    # quantized (tests/kernels/test_int_attention.py checks it against its own twin)
    out = nda.decode_attention(q, kt, vt, n_tail, kw, vw, kn, vn, attn="fp32")
    assert out is not None and out.shape == q.shape and out.dtype == q.dtype
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    assert_close(out.float(), dequantized_reference(q, kt, vt, n_tail, kw, vw, kn, vn), **tol)


@has_native
@pytest.mark.parametrize("kv", ["cb-2", "cb-3", "cb-4", "cb-4/cb-3", "cb-2/cb-4"])
@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "-".join(map(str, g)))
def test_native_attention_matches_dequantized_reference(kv, geom):
    km, _, vm = kv.partition("/")
    _check_native(km, vm or km, geom)


@has_native
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_native_half_inputs(dtype):
    _check_native("cb-3", "cb-3", GEOMS[0], dtype)


@has_native
def test_native_mass_matches_torch():
    Hkv, Gq, D, n_tail, W, T = 2, 3, 64, 96, 20, 5
    q, kt, vt, kw, vw, kn, vn = attention_case("cb-4", "cb-2", Hkv, Gq, D, n_tail, W, T)
    N = n_tail + W + T
    m1, m2 = torch.zeros(Hkv * Gq, N), torch.zeros(Hkv * Gq, N)
    nda.decode_attention(q, kt, vt, n_tail, kw, vw, kn, vn, mass=m1, mass_from=2)
    torch_attention(q, kt, vt, n_tail, kw, vw, kn, vn, mass=m2, mass_from=2)
    assert m1.abs().sum() > 0
    assert_close(m1, m2, atol=1e-5, rtol=1e-4)


@has_native
@pytest.mark.parametrize("T", [1, 3])
def test_native_fused_append_equals_the_steps(T):
    """attend_append (rotate + round + window write + attention in one call) equals the
    steps one by one: rotate, round to fp16, attend, un-rotate."""
    Hkv, Gq, D, n_tail, W = 2, 3, 64, 64, 10
    q, kt, vt, kw, vw, kn, vn = attention_case("cb-3", "cb-4", Hkv, Gq, D, n_tail, W, T)
    r = rotation_matrix(D, torch.randint(0, 2, (D,)).float() * 2 - 1)
    kd, vd = torch.zeros(Hkv, T, D, dtype=torch.float16), torch.zeros(Hkv, T, D, dtype=torch.float16)
    out = nda.attend_append(q, kt, vt, n_tail, kw, vw, kn, vn, kd, vd, r, r)
    assert_close(kd, (kn[0] @ r).half())
    assert_close(vd, (vn[0] @ r).half())
    ref = torch_attention(q @ r, kt, vt, n_tail, kw, vw, kd[None], vd[None]) @ r.T
    assert_close(out, ref, atol=2e-5, rtol=1e-4)


@has_native
@pytest.mark.parametrize("kv", ["cb-4/kivi-4", "kivi-4/cb-4", "kivi-2/cb-3", "int8/cb-2",
                                "cb-3/int8", "tada-4/cb-4", "cb-4/fp16", "fp16/cb-3"])
@pytest.mark.parametrize("geom", [GEOMS[0], GEOMS[2], GEOMS[5]], ids=lambda g: "-".join(map(str, g)))
def test_native_mixed_pairs_match_dequantized_reference(kv, geom):
    """A cb role beside any other codec: each role is read by its own kind in one kernel."""
    km, _, vm = kv.partition("/")
    _check_native(km, vm, geom)


@has_native
def test_native_mixed_pair_is_the_native_route():
    """dispatch sends a mixed pair to the native kernel, not to torch."""
    args = attention_case("kivi-4", "cb-4", 2, 3, 64, 64, 5, 1)
    out = dispatch.decode_attention(args[0], *args[1:3], 64, *args[3:], backend="native")
    ref = nda.decode_attention(args[0], *args[1:3], 64, *args[3:], attn=dispatch.attn_path())
    assert torch.equal(out, ref)


@pytest.fixture(params=[("-DKVRUN_NO_AVX512",), ("-DKVRUN_NO_AVX512", "-DKVRUN_NO_AVX2")],
                ids=["avx2", "plain-c"])
def portable(request, monkeypatch):
    """The kernel built without its AVX-512 paths: the AVX2 lookups (8 codes a register), or
    with neither, plain C (table reads into an L1 tile)."""
    lib = ctypes.CDLL(str(native._build(request.param)))
    lib.kvrun_decode_attention.restype = ctypes.c_int
    monkeypatch.setattr(nda, "load", lambda: lib)


@has_native
@pytest.mark.parametrize("kv", ["cb-2", "cb-3/cb-4", "cb-4/cb-3"])
def test_portable_path_matches_dequantized_reference(portable, kv):
    km, _, vm = kv.partition("/")
    for geom in GEOMS[:3] + GEOMS[5:]:
        _check_native(km, vm or km, geom)


# -- names, configuration, the arena --------------------------------------------------------------
def test_names_parse_and_pair():
    assert method_family("cb-3") == ("cb", 3)
    kv = parse_kv("cb-4/cb-3@64")
    assert (kv.k_method, kv.v_method, kv.group) == ("cb-4", "cb-3", 64)
    with pytest.raises(KvrunError, match="cb-5"):
        parse_kv("cb-5")
    with pytest.raises(KvrunError, match="multiple of 32"):
        parse_kv("cb-4").check_model(80, 2)


def test_arena_rotates_codebook_roles_only():
    """cb stores rotated rows whatever --kv's +rot says; the other codec's role is left."""
    from kvrun.kv import build_cache
    from tiny import tiny_config
    c = build_cache(tiny_config(num_layers=2, num_heads=6, num_kv_heads=2, hidden_size=384,
                                max_position=1024), 256, parse_kv("kivi-4/cb-3"))
    assert c.rot_k == [None, None] and all(r is not None for r in c.rot_v)


@pytest.mark.parametrize("bits", BITS)
def test_repacking_a_reconstruction_gives_the_same_bytes(bits):
    """Token eviction re-packs dequantized rows: the codes and scales must come back (the
    levels are fixed points of the quantizer at any scale near the row's own)."""
    torch.manual_seed(0)
    c = make_codec(f"cb-{bits}", "k", 32)
    a, b = c.alloc(3, 64, 64), c.alloc(3, 64, 64)
    c.store(a, torch.randn(3, 64, 64) * 3, 0)
    c.store(b, c.dequant(a, 0, 64), 0)
    assert torch.equal(a["codes"], b["codes"])
    assert_close(b["scale"].float(), a["scale"].float(), rtol=1e-3, atol=0)
