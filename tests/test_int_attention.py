"""The native attention's integer q.K over KIVI keys (KVRUN_ATTN=int: decode_attention.c
kivi_tiles_int, kdot_int.c) against its torch twin: per query row and 32-token tile the row
folded with the tile's channel scales, q s, quantized to int16 with one scale exactly as the C
code does (rint(q s * (32767 / max|q s|)), half to even), the int32 sums over the codes exact,
the zero-point term q . z and everything after the logits (softmax, p.V over the dequantized
V, window, new tokens) in fp32. Only fp32 rounding order separates the two, so the tolerance
is the fp32 tests' (2e-5). Odd tile counts (a split starting inside a chanpack block), GQA
rows 1-8, prefill chunks, head dims 64 and 256, 2, 3 and 4 bits, groups of 32 and 64 tokens,
on each build this machine runs (the portable build: the plain C integer path). The integer
pieces themselves (kdot_int.c ki_quantize, ki_dot) are checked exactly, bit for bit."""
import ctypes
import math

import pytest
import torch
from torch.testing import assert_close

from attention_cases import attention_case
from kvrun.kernels import chanpack, dispatch, native
from kvrun.kernels.native import decode_attention as nda

QMAX = 32767.0                    # kdot_int.h KI_QMAX
pytestmark = pytest.mark.skipif(native.load() is None, reason=f"native kernels unavailable: {native.error()}")


def int_reference(q, kt, vt, n_tail, kw, vw, kn, vn):
    """Attention with the tail's logits on the integer scheme (module docstring); q (1, H, T, D)."""
    (kc, ks), (vc, vs) = kt, vt
    _, H, T, D = q.shape
    Hkv = kw.shape[1]
    R, G, nt = H // Hkv * T, kc.G, n_tail // 32
    qh = (q.float() * (1.0 / math.sqrt(D)))[0].reshape(Hkv, R, D)           # (Hkv, R, D)
    grp = torch.arange(nt) * 32 // G                                      # tile -> token group
    s = ks["scale"][:, grp].float()[:, :, None]                           # (Hkv, nt, 1, D)
    z = ks["zero"][:, grp].float()[:, :, None]
    qs = qh[:, None] * s                                                  # (Hkv, nt, R, D)
    amax = qs.abs().amax(-1, keepdim=True)
    qi = torch.round(qs * torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax)))
    codes = sum(chanpack.codes(ks[name], 0, n_tail, w) * (1 << sh)         # 3 bits: two planes
                for name, w, sh in chanpack.planes(kc.bits)).view(Hkv, nt, 32, D)
    dots = torch.einsum("hnrd,hnjd->hnrj", qi.double(), codes.double())  # exact integers
    bias = (qh[:, None] * z).sum(-1, keepdim=True)                        # (Hkv, nt, R, 1)
    tail = (dots.float().double() * (amax / QMAX).double() + bias.double()).float()   # C: fmaf(float(sum), d, q . z)
    tail = tail.permute(0, 2, 1, 3).reshape(Hkv, R, n_tail)               # (Hkv, R, n_tail)
    # the rest in fp32: window and new keys' logits, causal softmax, p.V
    K = torch.cat([kw.float(), kn.float()], 2)[0]                         # (Hkv, W + Tn, D)
    V = torch.cat([vc.dequant(vs, 0, n_tail)[None], vw.float(), vn.float()], 2)[0]
    logits = torch.cat([tail, qh @ K.transpose(1, 2)], 2)                 # (Hkv, R, N)
    N = logits.shape[2]
    t = torch.arange(R) % T                                               # rows ordered (g, t)
    visible = torch.arange(N)[None] <= (N - T + t)[:, None]
    p = torch.softmax(logits.masked_fill(~visible, -math.inf), -1)
    return (p @ V).reshape(1, H, T, D)


def _build_order(lib, D: int) -> torch.Tensor:
    """Channel order of ki_quantize's output on `lib`'s build: within each 4 channels d, d+2,
    d+1, d+3 on AVX512-VNNI (the words vpdpwssd pairs), as is on the others."""
    order = torch.arange(D)
    if lib.kvrun_gemv_isa() == 2:
        order = order.view(-1, 4)[:, [0, 2, 1, 3]].reshape(-1)
    return order


@pytest.mark.parametrize("build", ["default", "portable"])
@pytest.mark.parametrize("bits,P,R,D,plane,third", [(4, 2, 3, 64, 0, 0), (4, 1, 12, 256, 1, 0),
                                                    (2, 4, 3, 64, 0, 0), (2, 3, 4, 68, 1, 0),
                                                    (2, 2, 5, 4, 2, 0), (8, 1, 7, 256, 0, 0),
                                                    (4, 2, 6, 36, 0, 0), (2, 4, 3, 64, 0, 4),
                                                    (2, 3, 4, 68, 1, 1), (2, 1, 12, 252, 3, 7)])
def test_quantize_and_int_dots_are_exact(build, bits, P, R, D, plane, third):
    """third: 3-bit keys' third bits from a second buffer at bit `third` + p (0: none)."""
    lib = ctypes.CDLL(str(native._build(() if build == "default" else ("-DKVRUN_NO_AVX512",))))
    lib.ki_quantize.restype = ctypes.c_float
    g = torch.Generator().manual_seed(bits * 100 + D)
    x = torch.randn(P * R, D, generator=g) * torch.rand(D, generator=g) * 3     # uneven channels
    x[0, 1] = 0.0
    qi = torch.empty(P * R, D, dtype=torch.int16)
    d = [lib.ki_quantize(ctypes.c_void_p(x[i].data_ptr()), D, ctypes.c_void_p(qi[i].data_ptr()))
         for i in range(P * R)]
    amax = x.abs().amax(1, keepdim=True)
    want = torch.round(x * (torch.full_like(amax, QMAX) / amax)).to(torch.int16)  # (QMAX / t: a reciprocal)
    order = _build_order(lib, D)
    assert torch.equal(qi, want[:, order])
    assert d == (amax[:, 0] / QMAX).tolist()
    ds = 96                                          # bytes from one channel row to the next
    buf = torch.randint(0, 256, (D * ds,), dtype=torch.uint8, generator=g)
    out = torch.empty(P * R, 32, dtype=torch.int32)
    sh = bits * plane
    hbuf = torch.randint(0, 256, (D * 64,), dtype=torch.uint8, generator=g)   # rows 64 bytes apart
    hb = ctypes.c_void_p(hbuf.data_ptr() + 32 if third else None)
    lib.ki_dot(ctypes.c_void_p(buf.data_ptr() + 32), ctypes.c_int64(ds), D, bits, sh, hb,
               ctypes.c_int64(64), third, P, R, ctypes.c_void_p(qi.data_ptr()),
               ctypes.c_void_p(out.data_ptr()))
    rows = buf.view(D, ds)[:, 32:64].long()                                   # (D, 32) bytes
    codes = torch.stack([(rows >> (sh + bits * p)) & (2 ** bits - 1) for p in range(P)])  # (P, D, 32)
    if third:
        hrows = hbuf.view(D, 64)[:, 32:64].long()
        codes += torch.stack([((hrows >> (third + p)) & 1) << 2 for p in range(P)])
    ref = torch.einsum("prd,pdj->prj", want.long().view(P, R, D), codes).reshape(P * R, 32)
    assert torch.equal(out.long(), ref)


def _case(bits, G, Hkv, Gq, D, tiles, W, T, seed=0):
    v = "kivi-4" if bits == 3 else f"kivi-{bits}"        # kivi-3 is a key codec
    return attention_case(f"kivi-{bits}", v, Hkv, Gq, D, 32 * tiles, W, T, G=G, seed=seed)


GEOMS = [(3, 1, 64, 1, 1), (3, 3, 64, 3, 1), (1, 4, 256, 5, 1), (2, 8, 64, 5, 1),
         (1, 4, 256, 3, 3), (2, 3, 64, 9, 4)]       # (Hkv, Gq, D, tiles, T): R = Gq T


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("G", [32, 64])
@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "-".join(map(str, g)))
def test_int_path_matches_its_torch_twin(bits, G, geom):
    Hkv, Gq, D, tiles, T = geom
    tiles = tiles * G // 32                      # whole groups; odd tile counts at G = 32
    q, kt, vt, kw, vw, kn, vn = _case(bits, G, Hkv, Gq, D, tiles, 7, T)
    out = nda.decode_attention(q, kt, vt, 32 * tiles, kw, vw, kn, vn, attn="int")
    ref = int_reference(q, kt, vt, 32 * tiles, kw, vw, kn, vn)
    assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("vm", ["cb-4", "cb-3", "int8"])
def test_int_keys_beside_another_v_codec(vm):
    """KIVI keys on the integer path beside a V of another kind (the searched profiles pair
    KIVI K with codebook V): the same logits as the twin, that V read in fp32."""
    q, kt, vt, kw, vw, kn, vn = attention_case("kivi-4", vm, 2, 3, 64, 160, 7, 1, seed=3)
    out = nda.decode_attention(q, kt, vt, 160, kw, vw, kn, vn, attn="int")
    assert_close(out, int_reference(q, kt, vt, 160, kw, vw, kn, vn), atol=2e-5, rtol=1e-4)


def test_the_paths_differ_and_agree_to_the_quantization_step():
    """The int path is not the fp32 one (the twin test could not tell them apart otherwise),
    and they differ by what int16 queries move: a logit by ~1e-4 of its spread here, an
    output by < 1e-3."""
    q, kt, vt, kw, vw, kn, vn = _case(4, 32, 2, 3, 64, 8, 5, 1)
    args = (q, kt, vt, 256, kw, vw, kn, vn)
    o_int, o_fp = nda.decode_attention(*args, attn="int"), nda.decode_attention(*args, attn="fp32")
    ref = int_reference(*args)
    assert_close(o_int, ref, atol=2e-5, rtol=1e-4)
    assert (o_fp - ref).abs().max() > 1e-6
    assert_close(o_int, o_fp, atol=1e-3, rtol=0)


def test_fused_step_and_dispatch_follow_the_switch(monkeypatch):
    """KVRUN_ATTN picks the path of every native entry: the general op and the arena's
    one-token step (rebuilt when the switch changes); a bad value is a one-line error."""
    q, kt, vt, kw, vw, kn, vn = _case(4, 32, 3, 3, 64, 4, 6, 1)
    kn, vn = kn.half().float(), vn.half().float()        # as the step stores them: fp16 rows
    args = (q, kt, vt, 128, kw, vw, kn, vn)
    want = {a: nda.decode_attention(*args, attn=a) for a in ("int", "fp32")}
    win_k = torch.cat([kw[0], torch.zeros(3, 4, 64, dtype=kw.dtype)], 1)[None]   # (L, Hkv, cap, D)
    win_v = torch.cat([vw[0], torch.zeros(3, 4, 64, dtype=vw.dtype)], 1)[None]
    for a in ("int", "fp32"):
        monkeypatch.setenv("KVRUN_ATTN", a)
        assert torch.equal(dispatch.decode_attention(*args, backend="native"), want[a])
        step = dispatch.fused_step(win_k, win_v, 0, 9, backend="native")
        assert step.attn == a
        assert torch.equal(step(q, kt, vt, 128, 6, kn, vn), want[a])
    monkeypatch.delenv("KVRUN_ATTN")                     # unset: int where the build has VNNI
    assert dispatch.attn_path() == ("int" if native.load().kvrun_gemv_isa() == 2 else "fp32")
    monkeypatch.setenv("KVRUN_ATTN", "int4")
    with pytest.raises(dispatch.BackendError, match="KVRUN_ATTN='int4': expected one of fp32, int"):
        dispatch.attn_path()


@pytest.fixture
def portable(monkeypatch):
    """The kernel built without AVX-512: the plain C integer path."""
    lib = ctypes.CDLL(str(native._build(("-DKVRUN_NO_AVX512",))))
    lib.kvrun_decode_attention.restype = ctypes.c_int
    monkeypatch.setattr(nda, "load", lambda: lib)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_portable_build_matches_the_twin(portable, bits):
    for Hkv, Gq, D, tiles, T in GEOMS[1:4]:
        q, kt, vt, kw, vw, kn, vn = _case(bits, 32, Hkv, Gq, D, tiles, 7, T)
        out = nda.decode_attention(q, kt, vt, 32 * tiles, kw, vw, kn, vn, attn="int")
        assert_close(out, int_reference(q, kt, vt, 32 * tiles, kw, vw, kn, vn), atol=2e-5, rtol=1e-4)
