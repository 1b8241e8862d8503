"""The native attention's integer q.K over KIVI and int8 keys and p.V over KIVI and int8
values (KVRUN_ATTN=int: decode_attention.c kivi_tiles_int, int8_tiles_int and vmix_int,
kdot_int.c) against its torch twin. int8 keys: each query row quantized to int16 once, the
products with the codes exact, times the row's and the token's scales in fp32. KIVI keys: per
query row and 32-token tile the row folded with the tile's channel scales, q s, quantized to
int16 with one scale exactly as the C code does (rint(q s * (32767 / max|q s|)), half to
even), the int32 sums over the codes exact, the zero-point term q . z in fp32. Softmax in
fp32. p.V over the tail likewise: the weights p s of a row, channel group and run of up to
256 tokens (`token_runs`) quantized to int16 and summed over the codes in int32, plus sum p z
(int8: one group, z = -128 s); the window and new tokens in fp32.
Only fp32 rounding order separates the two, so the tolerance is the fp32 tests' (2e-5), plus,
for p.V, the weights whose rounding the C probabilities (a few ulps from torch's softmax) can
tip to the next integer: each such weight may move an output by one step times its code
(`v_tail`'s slack). Odd tile counts (a split starting inside a chanpack block), GQA
rows 1-8, prefill chunks, head dims 64 and 256, 2, 3 and 4 bits, groups of 32 and 64 tokens,
on each build this machine runs (AVX512-VNNI, AVX2, plain C: `BUILDS`). The integer
pieces themselves (kdot_int.c ki_quantize, ki_dot) are checked exactly, bit for bit."""
import ctypes
import math

import pytest
import torch
from torch.testing import assert_close

from attention_cases import attention_case
from kvrun.kernels import chanpack, dispatch, native, nibble
from kvrun.kernels.native import decode_attention as nda


def int_reference(q, kt, vt, n_tail, kw, vw, kn, vn):
    """Attention with the tail on the integer scheme (module docstring); q (1, H, T, D).
    Returns (output, slack): the p.V weights' rounding-tie allowance per output element."""
    kc, ks = kt
    _, H, T, D = q.shape
    Hkv = kw.shape[1]
    R = H // Hkv * T
    qh = (q.float() * (1.0 / math.sqrt(D)))[0].reshape(Hkv, R, D)           # (Hkv, R, D)
    if kc.kind == "kivi":
        tail = kivi_logits(qh, kc, ks, n_tail)
    elif kc.kind == "int8":
        tail = int8_logits(qh, ks, n_tail)
    else:                                                                 # read in fp32
        tail = qh @ kc.dequant(ks, 0, n_tail).transpose(1, 2)
    # window and new keys' logits and the causal softmax in fp32
    K = torch.cat([kw.float(), kn.float()], 2)[0]                         # (Hkv, W + Tn, D)
    logits = torch.cat([tail, qh @ K.transpose(1, 2)], 2)                 # (Hkv, R, N)
    N = logits.shape[2]
    t = torch.arange(R) % T                                               # rows ordered (g, t)
    visible = torch.arange(N)[None] <= (N - T + t)[:, None]
    p = torch.softmax(logits.masked_fill(~visible, -math.inf), -1)
    V = torch.cat([vw.float(), vn.float()], 2)[0]                         # (Hkv, W + Tn, D)
    tail_v, slack = v_tail(p[:, :, :n_tail], vt, n_tail)
    return (p[:, :, n_tail:] @ V + tail_v).reshape(1, H, T, D), slack.reshape(1, H, T, D)


def assert_twin(out, twin):
    ref, slack = twin
    err = (out - ref).abs()
    bound = 2e-5 + 1e-4 * ref.abs() + slack
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"

QMAX = 32767.0                    # kdot_int.h KI_QMAX
pytestmark = pytest.mark.skipif(native.load() is None, reason=f"native kernels unavailable: {native.error()}")


def kivi_logits(qh, kc, ks, n_tail):
    """The tail's logits (Hkv, R, n_tail) of the folded, int16-quantized rows over KIVI keys."""
    Hkv, R, D = qh.shape
    G, nt = kc.G, n_tail // 32
    grp = torch.arange(nt) * 32 // G                                      # tile -> token group
    s = ks["scale"][:, grp].float()[:, :, None]                           # (Hkv, nt, 1, D)
    z = ks["zero"][:, grp].float()[:, :, None]
    qs = qh[:, None] * s                                                  # (Hkv, nt, R, D)
    amax = qs.abs().amax(-1, keepdim=True)
    qi = torch.round(qs * torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax)))
    codes = sum(chanpack.codes(ks[name], 0, n_tail, w) * (1 << sh)         # 3 bits: two planes
                for name, w, sh in chanpack.byte_planes(kc.bits)).view(Hkv, nt, 32, D)
    dots = torch.einsum("hnrd,hnjd->hnrj", qi.double(), codes.double())  # exact integers
    bias = (qh[:, None] * z).sum(-1, keepdim=True)                        # (Hkv, nt, R, 1)
    tail = (dots.float().double() * (amax / QMAX).double() + bias.double()).float()   # C: fmaf(float(sum), d, q . z)
    tail = tail.permute(0, 2, 1, 3).reshape(Hkv, R, n_tail)               # (Hkv, R, n_tail)
    return tail


def int8_logits(qh, ks, n_tail):
    """The tail's logits over int8 keys: each row quantized to int16 once (no fold: the
    scale is per token), s_t (d (q_int16 . (u_t - 128))) with the integer exact and the two
    products in fp32 as the C code orders them."""
    amax = qh.abs().amax(-1, keepdim=True)                                # (Hkv, R, 1)
    qi = torch.round(qh * torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax)))
    u = nibble.tok_codes(ks["codes"], 0, n_tail, 8) - 128                 # (Hkv, n, D)
    x = torch.einsum("hrd,hnd->hrn", qi.double(), u.double()).float()     # exact, one rounding
    return ks["scale"][:, None, :n_tail].float() * (x * (amax / QMAX))

def token_runs(n_tail):
    """The runs of tail tokens the C code quantizes p.V's weights over: each token split
    (math_inline.h token_splits) in chunks of up to 256 tokens."""
    ntile = n_tail // 32
    nsplit = min(max(ntile // 4, 2), 8)
    for sp in range(nsplit):
        b0, b1 = ntile * sp // nsplit * 32, ntile * (sp + 1) // nsplit * 32
        yield from ((c0, min(c0 + 256, b1)) for c0 in range(b0, b1, 256))


def v_tail(p, vt, n_tail):
    """(p (Hkv, R, n_tail) . the tail's V, slack): integer weights over KIVI codes (2 or 4
    bits, channel groups of a multiple of 32) and int8 codes, else over the dequantized V in
    fp32 (no slack).
    A weight w q / d within 1e-5 relative (+ 1e-3) of a rounding tie may round the other way
    in C, whose p differ from torch's by ulps: each adds its step d times its code to the
    slack of the outputs it feeds."""
    vc, vs = vt
    if vc.kind != "int8" and (vc.kind != "kivi" or vc.bits not in (2, 4) or vc.g % 32):
        out = p @ vc.dequant(vs, 0, n_tail)
        return out, torch.zeros_like(out)
    Hkv, R, _ = p.shape
    D = vc.D
    g = D if vc.kind == "int8" else vc.g                                  # int8: one group, z = -128 s
    codes = nibble.chan_codes(vs["codes"], 0, n_tail, vc.bits, D).view(Hkv, n_tail, D // g, g)
    if vc.kind == "int8":
        s = vs["scale"][:, :n_tail, None].float()
        z = -128 * s
    else:
        s, z = (vs[k][:, :n_tail].float() for k in ("scale", "zero"))      # (Hkv, n, ng)
    out = torch.zeros(Hkv, R, D // g, g, dtype=torch.float64)
    slack = torch.zeros_like(out)
    for c0, c1 in token_runs(n_tail):
        x = p[:, :, c0:c1, None] * s[:, None, c0:c1]                      # w = p s, fp32 (Hkv, R, n, ng)
        amax = x.abs().amax(2, keepdim=True)                              # per row, run, group
        y = x * torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))
        c = codes[:, c0:c1].double()
        dots = torch.einsum("hrjg,hjgc->hrgc", torch.round(y).double(), c)  # exact integers
        step = (amax / QMAX)[:, :, 0, :, None]                            # (Hkv, R, ng, 1)
        zsum = torch.einsum("hrj,hjg->hrg", p[:, :, c0:c1].double(), z[:, c0:c1].double())[..., None]
        out += (dots.float() * step).double() + zsum
        tie = ((y - y.floor() - 0.5).abs() < 1e-5 * y + 1e-3).double()
        slack += torch.einsum("hrjg,hjgc->hrgc", tie, c) * step.double()
    return out.float().reshape(Hkv, R, D), slack.float().reshape(Hkv, R, D)


def _build_order(lib, D: int) -> torch.Tensor:
    """Channel order of ki_quantize's output on `lib`'s build: within each 4 channels d, d+2,
    d+1, d+3 on AVX512-VNNI (the words vpdpwssd pairs), as is on the others."""
    order = torch.arange(D)
    if lib.kvrun_gemv_isa() == 2:
        order = order.view(-1, 4)[:, [0, 2, 1, 3]].reshape(-1)
    return order


BUILDS = {"default": (), "portable": ("-DKVRUN_NO_AVX512",),   # AVX2 where the CPU has it
          "plain": ("-DKVRUN_NO_AVX512", "-DKVRUN_NO_AVX2"),
          "no-gfni": ("-mno-gfni",)}      # AVX512-VNNI without GFNI: 3-bit keys merged by shifts
KERNEL_BUILDS = ["default", "portable", "plain"]


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("bits,P,R,D,plane,third", [(4, 2, 3, 64, 0, 0), (4, 1, 12, 256, 1, 0),
                                                    (2, 4, 3, 64, 0, 0), (2, 3, 4, 68, 1, 0),
                                                    (2, 2, 5, 4, 2, 0), (8, 1, 7, 256, 0, 0),
                                                    (4, 2, 6, 36, 0, 0), (2, 4, 3, 64, 0, 4),
                                                    (2, 3, 4, 68, 1, 1), (2, 1, 12, 252, 3, 7)])
def test_quantize_and_int_dots_are_exact(build, bits, P, R, D, plane, third):
    """third: 3-bit keys' third bits from a second buffer at bit `third` + p (0: none)."""
    lib = ctypes.CDLL(str(native._build(BUILDS[build])))
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
    hy = torch.zeros(D * 32, dtype=torch.uint8)         # the third bits' transposed rows

    def dots(hmode):
        lib.ki_dot(ctypes.c_void_p(buf.data_ptr() + 32), ctypes.c_int64(ds), D, bits, sh, hb,
                   ctypes.c_int64(64), third, ctypes.c_void_p(hy.data_ptr()), hmode, P, R,
                   ctypes.c_void_p(qi.data_ptr()), ctypes.c_void_p(out.data_ptr()))
        return out.long()
    rows = buf.view(D, ds)[:, 32:64].long()                                   # (D, 32) bytes
    codes = torch.stack([(rows >> (sh + bits * p)) & (2 ** bits - 1) for p in range(P)])  # (P, D, 32)
    if third:
        hrows = hbuf.view(D, 64)[:, 32:64].long()
        codes += torch.stack([((hrows >> (third + p)) & 1) << 2 for p in range(P)])
    ref = torch.einsum("prd,pdj->prj", want.long().view(P, R, D), codes).reshape(P * R, 32)
    assert torch.equal(dots(0), ref)
    if third:       # kept rows (KI_HY_FILL), then read back (KI_HY_READ) with the bytes gone
        assert torch.equal(dots(1), ref)
        hbuf.zero_()
        if lib.kvrun_gemv_isa() == 2:                    # only the VNNI build keeps them
            assert torch.equal(dots(2), ref)


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
    assert_twin(out, int_reference(q, kt, vt, 32 * tiles, kw, vw, kn, vn))


@pytest.mark.parametrize("vm", ["cb-4", "cb-3", "int8"])
def test_int_keys_beside_another_v_codec(vm):
    """KIVI keys on the integer path beside a V of another kind (the searched profiles pair
    KIVI K with codebook V): the same logits as the twin, that V read in fp32."""
    q, kt, vt, kw, vw, kn, vn = attention_case("kivi-4", vm, 2, 3, 64, 160, 7, 1, seed=3)
    out = nda.decode_attention(q, kt, vt, 160, kw, vw, kn, vn, attn="int")
    assert_twin(out, int_reference(q, kt, vt, 160, kw, vw, kn, vn))


def test_the_paths_differ_and_agree_to_the_quantization_step():
    """The int path is not the fp32 one (the twin test could not tell them apart otherwise),
    and they differ by what int16 queries move: a logit by ~1e-4 of its spread here, an
    output by < 1e-3."""
    q, kt, vt, kw, vw, kn, vn = _case(4, 32, 2, 3, 64, 8, 5, 1)
    args = (q, kt, vt, 256, kw, vw, kn, vn)
    o_int, o_fp = nda.decode_attention(*args, attn="int"), nda.decode_attention(*args, attn="fp32")
    ref, slack = twin = int_reference(*args)
    assert_twin(o_int, twin)
    assert ((o_fp - ref).abs() > 2e-5 + slack).any()
    assert_close(o_int, o_fp, atol=1e-3, rtol=0)


@pytest.mark.parametrize("vm,g,n", [("kivi-4", 64, 192), ("kivi-2", 32, 192), ("kivi-4", 128, 192),
                                    ("kivi-4", 16, 192), ("kivi-2", 64, 2560), ("kivi-4", 32, 2560),
                                    ("int8", 32, 192), ("int8", 32, 2560)])
def test_int_values_beside_fp16_keys(vm, g, n):
    """fp16 keys (read in fp32 on both paths) isolate p.V: the integer weights follow the twin
    and are not the fp32 mix; groups of 16 channels have no integer path (the fp32 fold).
    2560 tokens: splits of 320, runs of 256 + 64."""
    q, kt, vt, kw, vw, kn, vn = attention_case("fp16", vm, 2, 4, 128, n, 5, 1, v_group=g, seed=5)
    args = (q, kt, vt, n, kw, vw, kn, vn)
    o_int, o_fp = nda.decode_attention(*args, attn="int"), nda.decode_attention(*args, attn="fp32")
    ref, slack = twin = int_reference(*args)
    assert_twin(o_int, twin)
    moved = ((o_int - o_fp).abs() > 2e-5 + 1e-4 * ref.abs() + slack).any()
    assert bool(moved) == (g % 32 == 0)
    assert_close(o_int, o_fp, atol=1e-3, rtol=0)


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("geom", [(3, 3, 64, 1, 5), (1, 4, 256, 1, 6), (2, 3, 64, 4, 3), (2, 8, 36, 2, 9)],
                         ids=lambda g: "-".join(map(str, g)))
def test_int8_keys_on_the_integer_path(build, geom, monkeypatch):
    """int8 keys (R = Gq T rows, odd tile counts so calls start inside a 64-token block, D 36
    with D % 16 != 0), beside an fp16 V, on each build: the twin, and not the fp32 logits."""
    use_build(monkeypatch, build)
    Hkv, Gq, D, T, tiles = geom
    q, kt, vt, kw, vw, kn, vn = attention_case("int8", "fp16", Hkv, Gq, D, 32 * tiles, 6, T, seed=7)
    args = (q, kt, vt, 32 * tiles, kw, vw, kn, vn)
    o_int, o_fp = nda.decode_attention(*args, attn="int"), nda.decode_attention(*args, attn="fp32")
    ref, slack = twin = int_reference(*args)
    assert_twin(o_int, twin)
    assert ((o_fp - ref).abs() > 2e-5 + 1e-4 * ref.abs()).any()
    assert_close(o_int, o_fp, atol=1e-3, rtol=0)


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("bits,sh,R,lo_hi", [(4, 0, 3, False), (4, 0, 4, True), (2, 2, 1, True),
                                             (2, 0, 4, False), (4, 0, 2, True)])
def test_value_weights_and_int_mix_are_exact(build, bits, sh, R, lo_hi):
    """kv_quantize (token order, ki_quantize's rounding) and kv_mix's int32 sums added to
    what out held, bit for bit; lo_hi: the two 32-channel halves of the block with weights of
    their own (groups of 32)."""
    lib = ctypes.CDLL(str(native._build(BUILDS[build])))
    lib.kv_quantize.restype = ctypes.c_float
    g = torch.Generator().manual_seed(bits * 10 + R)
    x = torch.rand(2 * R, 32, generator=g) ** 4                       # softmax-like: many small
    x[0, 3] = 0.0
    wq = torch.empty(2 * R, 32, dtype=torch.int16)
    d = [lib.kv_quantize(ctypes.c_void_p(x[i].data_ptr()), 32, ctypes.c_void_p(wq[i].data_ptr()))
         for i in range(2 * R)]
    amax = x.amax(1, keepdim=True)
    assert torch.equal(wq, torch.round(x * (torch.full_like(amax, QMAX) / amax)).to(torch.int16))
    assert d == (amax[:, 0] / QMAX).tolist()
    rs = 48                                                           # bytes from one token row to the next
    buf = torch.randint(0, 256, (32 * rs,), dtype=torch.uint8, generator=g)
    lo, hi = wq[:R], wq[R:] if lo_hi else wq[:R]
    init = torch.randint(-2 ** 30, 2 ** 30, (R, 64), dtype=torch.int32, generator=g)
    out = init.clone()
    lib.kv_mix(ctypes.c_void_p(buf.data_ptr() + 8), ctypes.c_int64(rs), bits, sh, R,
               ctypes.c_void_p(lo.data_ptr()), ctypes.c_void_p(hi.data_ptr()), 32,
               ctypes.c_void_p(out.data_ptr()))
    rows = buf.view(32, rs)[:, 8:40].long()                              # (32 tokens, 32 bytes)
    m = 2 ** bits - 1
    codes = torch.cat([(rows >> sh) & m, (rows >> (sh + 4)) & m], 1)   # (32, 64 channels)
    ref = torch.cat([lo.long() @ codes[:, :32], hi.long() @ codes[:, 32:]], 1)
    assert torch.equal(out.long(), init.long() + ref)


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("P,R,D,shifts", [(1, 3, 64, (0, 0)), (2, 5, 256, (0, 0)), (1, 12, 36, (4, 4)),
                                          (2, 4, 68, (0, 0))])
def test_int8_planes_dots_are_exact(build, P, R, D, shifts):
    """ki_dot8 and kv_mix8: int8 codes as two nibble planes, 16 hi + lo, bit for bit (AVX2
    reads both planes in one pass, the other builds call ki_dot / kv_mix per plane); the
    largest rows and codes reach 32767 * 255 * D, the int32 bound."""
    lib = ctypes.CDLL(str(native._build(BUILDS[build])))
    g = torch.Generator().manual_seed(P * 100 + R + D)
    qi = torch.randint(-32767, 32768, (P * R, D), dtype=torch.int16, generator=g)
    qi[0] = 32767
    ds, shh, shl = 80, *shifts                                  # bytes from one channel row to the next
    hbuf = torch.randint(0, 256, (D * ds,), dtype=torch.uint8, generator=g)
    lbuf = torch.randint(0, 256, (D * ds,), dtype=torch.uint8, generator=g)
    hbuf.view(D, ds)[:, 16:32] = 0xFF                           # tokens 0-15: code 255 in every tile
    lbuf.view(D, ds)[:, 16:32] = 0xFF
    out = torch.empty(P * R, 32, dtype=torch.int32)
    lib.ki_dot8(ctypes.c_void_p(hbuf.data_ptr() + 16), ctypes.c_int64(ds), shh,
                ctypes.c_void_p(lbuf.data_ptr() + 16), ctypes.c_int64(ds), shl, D, P, R,
                ctypes.c_void_p(qi.data_ptr()), ctypes.c_void_p(out.data_ptr()))
    hr, lr = (b.view(D, ds)[:, 16:48].long() for b in (hbuf, lbuf))
    codes = torch.stack([16 * ((hr >> (shh + 4 * p)) & 15) + ((lr >> (shl + 4 * p)) & 15)
                         for p in range(P)])                    # (P, D, 32)
    qc = qi[:, _build_order(lib, D)].long()                     # the words' channels on this build
    ref = torch.einsum("prd,pdj->prj", qc.view(P, R, D), codes).reshape(P * R, 32)
    assert torch.equal(out.long(), ref)
    # values: token rows of 32 bytes rs apart, the low plane pl bytes after the high one
    Rv, rs, pl = min(R, 4), 40, 32 * 40
    vbuf = torch.randint(0, 256, (2 * pl,), dtype=torch.uint8, generator=g)
    w = torch.randint(0, 32768, (2 * Rv, 32), dtype=torch.int16, generator=g)
    init = torch.randint(-2 ** 20, 2 ** 20, (Rv, 64), dtype=torch.int32, generator=g)
    got = init.clone()
    lib.kv_mix8(ctypes.c_void_p(vbuf.data_ptr()), ctypes.c_int64(pl), ctypes.c_int64(rs), Rv,
                ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(w[Rv:].data_ptr()), 32,
                ctypes.c_void_p(got.data_ptr()))
    hi, lo = vbuf[:pl].view(32, rs)[:, :32].long(), vbuf[pl:].view(32, rs)[:, :32].long()
    codes = torch.cat([16 * (hi & 15) + (lo & 15), 16 * (hi >> 4) + (lo >> 4)], 1)   # (32, 64)
    ref = torch.cat([w[:Rv].long() @ codes[:, :32], w[Rv:].long() @ codes[:, 32:]], 1)
    assert torch.equal(got.long(), init.long() + ref)


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
        step = dispatch.fused_step(win_k, win_v, 0, 9)
        assert step.attn == a
        assert torch.equal(step(q, kt, vt, 128, 6, kn, vn), want[a])
    monkeypatch.delenv("KVRUN_ATTN")                     # unset: int where the build has VNNI or AVX2
    assert dispatch.attn_path() == ("int" if native.load().kvrun_gemv_isa() >= 1 else "fp32")
    monkeypatch.setenv("KVRUN_ATTN", "int4")
    with pytest.raises(dispatch.BackendError, match="KVRUN_ATTN='int4': expected one of fp32, int"):
        dispatch.attn_path()


def use_build(monkeypatch, build):
    """decode_attention on `build` (BUILDS) for the rest of the test"""
    if build == "default":
        return
    lib = ctypes.CDLL(str(native._build(BUILDS[build])))
    lib.kvrun_decode_attention.restype = ctypes.c_int
    monkeypatch.setattr(nda, "load", lambda: lib)


@pytest.mark.parametrize("build", ["portable", "plain"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_portable_builds_match_the_twin(monkeypatch, build, bits):
    """without AVX-512: the AVX2 integer path (where the CPU has AVX2) and the plain C one"""
    use_build(monkeypatch, build)
    for Hkv, Gq, D, tiles, T in GEOMS[1:4]:
        q, kt, vt, kw, vw, kn, vn = _case(bits, 32, Hkv, Gq, D, tiles, 7, T)
        out = nda.decode_attention(q, kt, vt, 32 * tiles, kw, vw, kn, vn, attn="int")
        assert_twin(out, int_reference(q, kt, vt, 32 * tiles, kw, vw, kn, vn))
