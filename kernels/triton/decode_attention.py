"""decode_attention, Triton: split-K flash-decoding over the compressed tail + window + new
tokens (kernels/dispatch.py), reading the packed codes directly (no dequantized copy of the
cache). Same signature and semantics as kernels/decode_attention.py (the torch path, which
is this kernel's test oracle).

Structure (flash-decoding, Dao et al. 2023; lightllm's stage1/stage2), two launches:
- stage 1, `_stage1_kernel`, grid (Hkv, n_split + 1, cdiv(R, BLOCK_R)): one program per
  (KV head, part, block of query rows). The rows are the GQA group folded with the new
  queries, R = Gq*T, row r = (g, t) = (r // T, r % T), so each packed K/V tile is loaded
  and dequantized once for every query head that shares it (BLOCK_R covers the whole group
  for decode, T = 1, Gq <= 64). Parts 0..n_split-1 are splits of the compressed tail, read
  in the K and V codecs' formats (which may differ: the codec kinds are constexprs, so each
  pair compiles its own kernel); the last part is the fp16/bf16 window followed by the new
  tokens (causal: query t sees new tokens 0..t). Per BLOCK_N-token tile: dequantize K in
  registers (kernels/triton/dequant.py), s = q·k̂ᵀ (fp32 accumulate), online softmax in
  fp32 (base 2, log2(e) folded into the query scale), acc += p·V̂. Writes the part's
  normalized output o = acc / l and its log-sum-exp m + log2 l.
- stage 2, `_stage2_kernel`, grid (Hkv, cdiv(R, BLOCK_R)): merges the parts by log-sum-exp
  and writes (1, H, T, D) in q's dtype.
- only with `mass=` (token eviction's accumulated attention): stage 1 also stores every
  row's masked logits (Hkv, R, N) fp32, stage 2 the rows' final log-sum-exp, and
  `_mass_kernel`, grid (Hkv, cdiv(N, 128)), adds Σ_{t >= mass_from} 2^(s − lse) per query
  head into mass (H, N) — the torch path's p / den. Extra traffic: 2 · Hkv · R · N · 4
  bytes of logits (written, read) + 2 · H · N · 4 of mass (Llama-3.1-70B, 32k, T = 1:
  8 MiB + 16 MiB, a third of a kivi-4 step: eviction's scoring is not free).

Block sizes: BLOCK_N = 32 tokens (the nibble layouts' half-block; 16 when a codec is GEAR,
whose low-rank and outlier terms need more registers), BLOCK_D = next power of two >= D,
BLOCK_R = next power of two >= R clamped to [16, 32] (16: the smallest tl.dot tile; up to
64 over an uncompressed tail), 8 warps (4 at D <= 64); stage 2: BLOCK_R up to 32, 4 warps.
Compiled for sm_90 by ptxas (tools/sm90_check.py), no configuration spills registers at
D = 128, Gq = 8, T = 1..8, nor at SmolLM2's D = 64, Gq = 3 (126-254 registers per thread;
the smaller tiles for packed codecs and GEAR are what keeps them from spilling). Split
size: chosen so Hkv * n_splits ≈ 264 programs (2 per H100 SM), in whole 32-token tiles;
tails not a multiple of it end in a partial split.

Bytes per decode step (T = 1), one layer (`bytes_per_step`): read every packed byte of the
tail once — n_tail * bytes_per_token(K codec + V codec); TaDA's μ_t is shared by the Hkv
programs of a split, which run adjacently (the head is the fastest grid axis), so it comes
from HBM once and from L2 for the others — plus the window 2 * W * Hkv * D * 2, q, new K/V
and the output (written) 2 * D * (2H + 2Hkv), and the split-K partials, written by stage 1
and read by stage 2: 2 * n_parts * Hkv * R * (D + 1) * 4. Llama-3.1-70B attention (H 64,
Hkv 8, D 128, R 8) at 32k tokens (window 128, 34 parts): fp16 130.2 MiB (40.7 µs at
3.35 TB/s), int8 67.4 MiB, kivi-4 42.5 MiB (13.3 µs), kivi-2 26.6 MiB (8.3 µs), tada-4
52.5 MiB, gear-l 62.4 MiB, of which the partials are 2.1 MiB (tools/roofline.py).

Precision: dequantization and accumulation in fp32; on GPU tl.dot takes fp32 operands as
tf32 (10-bit mantissa — finer than the bf16 rounding of the torch path's packed products);
the interpreter computes exact fp32.

Soft-capped logits (`softcap` > 0, Gemma 2): each tile's scores s (base 2) become
cap2·tanh(s / cap2), cap2 = softcap·log2 e — the natural-log logits' cap·tanh(x / cap) in
base 2 — right after q·k̂ᵀ (`softcap_logits`, also the ring kernel's), before the mask; a
constexpr, so softcap 0 compiles the kernel as before.

Codecs: fp16, bf16 (any FpCodec dtype), int8, kivi-{2,4,8}, tada-{2,4,8} (fp16 or int8 μ), gear-l / gear
(KIVI backbone + rank-r term + sparse outliers, dequantized tile-wise in registers). Any
other codec kind (kernels/table.py) makes `supports` false and kernels/dispatch.py runs the torch path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..table import covers
from .dequant import FP, GEAR, INT8, KIVI, TADA, dequant_tile

_KINDS = {"fp": FP, "int8": INT8, "kivi": KIVI, "tada": TADA, "gear": GEAR}    # codec.kind → dequant_tile's KIND

BLOCK_N = 32                    # split granularity and default token tile
NUM_WARPS = 8
TARGET_PROGRAMS = 264           # 2 per SM of an H100 (132 SMs)
LOG2E = 1.4426950408889634
MASS_BLOCK_N = 128              # tokens per attention-mass program


@triton.jit
def softcap_logits(s, cap2, inv2):
    """cap2·tanh(s / cap2) of base-2 logits s (cap2 = cap·log2 e, inv2 = 2 / cap): the
    natural logits x = s / log2 e capped to cap·tanh(x / cap), in base 2. tanh(y) =
    1 − 2 / (e^{2y} + 1), e^{2y} = 2^{s·inv2} (saturating to ±cap2; Triton has no tanh)."""
    return cap2 - 2.0 * cap2 / (tl.exp2(s * inv2) + 1.0)


@triton.jit
def _attend_range(q, m_i, l_i, acc, h, lo, hi, tq, d, d_ok, D,
                  KX, KSC, KZP, KMU, KMUS, KLA, KLB, KOI, KOV,
                  k_sh, k_sp, k_sb, k_sch, k_G, k_VG, k_lah, k_lbh, k_oh,
                  VX, VSC, VZP, VMU, VMUS, VLA, VLB, VOI, VOV,
                  v_sh, v_sp, v_sb, v_sch, v_G, v_VG, v_lah, v_lbh, v_oh,
                  CAUSAL: tl.constexpr,
                  K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_MU8: tl.constexpr,
                  K_RANK: tl.constexpr, K_K2: tl.constexpr,
                  V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_MU8: tl.constexpr,
                  V_RANK: tl.constexpr, V_K2: tl.constexpr, BLOCK_N: tl.constexpr,
                  S_OUT=None, s_row=None, row_ok=None, s_off=0, STORE_S: tl.constexpr = False,
                  cap2=0.0, inv2=0.0, SOFTCAP: tl.constexpr = False):
    """Online softmax of the rows q (BR, BD) over tokens [lo, hi) of one K/V source,
    continuing (m_i, l_i, acc). STORE_S: also write the masked base-2 logits of token t to
    S_OUT + s_row + s_off + t (s_row (BR,): each row's offset; the attention-mass pass).
    SOFTCAP: the logits soft-capped first (softcap_logits)."""
    for n0 in range(lo, hi, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)                                  # (BN,) token index
        t_ok = t < hi
        tm = t_ok[:, None]
        msk = tm & d_ok[None, :]
        # -- dequantize the K tile, scores --------------------------------------------------
        k = dequant_tile(KX, KSC, KZP, KMU, KMUS, KLA, KLB, KOI, KOV,
                         k_sh, k_sp, k_sb, k_sch, k_G, k_VG, k_lah, k_lbh, k_oh,
                         h, t[:, None], d[None, :], tm, msk, D,
                         K_KIND, K_BITS, False, K_MU8, K_RANK, K_K2)    # (BN, BD)
        s = tl.dot(q, tl.trans(k))                                      # (BR, BN)
        if SOFTCAP:
            s = softcap_logits(s, cap2, inv2)
        ok = t_ok[None, :]
        if CAUSAL:
            ok = ok & (t[None, :] <= tq[:, None])
        s = tl.where(ok, s, float("-inf"))
        if STORE_S:
            tl.store(S_OUT + s_row[:, None] + s_off + t[None, :], s,
                     mask=row_ok[:, None] & t_ok[None, :])
        # -- online softmax (fp32, base 2) ----------------------------------------------------
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- dequantize the V tile, accumulate ------------------------------------------------
        v = dequant_tile(VX, VSC, VZP, VMU, VMUS, VLA, VLB, VOI, VOV,
                         v_sh, v_sp, v_sb, v_sch, v_G, v_VG, v_lah, v_lbh, v_oh,
                         h, t[:, None], d[None, :], tm, msk, D,
                         V_KIND, V_BITS, True, V_MU8, V_RANK, V_K2)     # (BN, BD)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attend_fp(q, m_i, l_i, acc, h, n, tq, d, d_ok, D, K, V, s_h, s_t,
               CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               S_OUT, s_row, row_ok, s_off, STORE_S: tl.constexpr, cap2, inv2,
               SOFTCAP: tl.constexpr):
    """_attend_range over a full-precision (Hkv, n, D) K/V pair (window or new tokens)."""
    return _attend_range(q, m_i, l_i, acc, h, 0, n, tq, d, d_ok, D,
                         K, K, K, K, K, K, K, K, K, s_h, 0, s_t, 0, 1, 1, 0, 0, 0,
                         V, V, V, V, V, V, V, V, V, s_h, 0, s_t, 0, 1, 1, 0, 0, 0,
                         CAUSAL, 0, 16, False, 0, 0, 0, 16, False, 0, 0, BLOCK_N,
                         S_OUT, s_row, row_ok, s_off, STORE_S, cap2, inv2, SOFTCAP)


@triton.jit
def _stage1_kernel(
        Q, sq_h, sq_t, sq_d,                                            # (1, H, T, D)
        KX, KSC, KZP, KMU, KMUS, KLA, KLB, KOI, KOV,                    # K codec storage
        k_sh, k_sp, k_sb, k_sch, k_G, k_VG, k_lah, k_lbh, k_oh,
        VX, VSC, VZP, VMU, VMUS, VLA, VLB, VOI, VOV,                    # V codec storage
        v_sh, v_sp, v_sb, v_sch, v_G, v_VG, v_lah, v_lbh, v_oh,
        KW, VW, sw_h, sw_t,                                             # (Hkv, W, D) window
        KN, VN, sn_h, sn_t,                                             # (Hkv, T, D) new tokens
        MID_O, MID_L,                                                   # (P, Hkv, R, D), (P, Hkv, R)
        S_OUT,                                                          # (Hkv, R, N) fp32 or dummy
        n_tail, n_split, split, W, T, Gq, R, D, qk_scale, cap2, inv2,
        K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_MU8: tl.constexpr,
        K_RANK: tl.constexpr, K_K2: tl.constexpr,
        V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_MU8: tl.constexpr,
        V_RANK: tl.constexpr, V_K2: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        STORE_S: tl.constexpr = False, SOFTCAP: tl.constexpr = False):
    """Grid (Hkv, n_split + 1, cdiv(R, BLOCK_R)); tiles (BLOCK_R rows, BLOCK_N tokens,
    BLOCK_D). Programs sp < n_split read tail tokens [sp·split, (sp+1)·split) — their packed
    K/V bytes once (Llama-3.1-70B, 32k, kivi-4: ≈ 155 KiB in each of 8 x 33 programs); the
    last program per head reads the fp16 window and the new tokens (causal). Each writes
    BLOCK_R * (D + 1) fp32 (STORE_S: and its rows' masked logits, (BR, n) fp32, into S_OUT
    for the attention-mass pass)."""
    h = tl.program_id(0)
    sp = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)           # (BR,) rows (g, t)
    row_ok = rows < R
    tq = rows % T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # -- the query rows of the GQA group, scaled once (softmax scale and log2 e) -----------
    qp = Q + (h * Gq + rows // T)[:, None] * sq_h + tq[:, None] * sq_t + d[None, :] * sq_d
    q = tl.load(qp, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * qk_scale

    m_i = tl.full((BLOCK_R,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    N = n_tail + W + T
    s_row = (h * R + rows) * N                                          # rows of S_OUT
    if sp < n_split:
        # -- a split of the compressed tail, in the K and V codecs' packed formats ------------
        lo = sp * split
        m_i, l_i, acc = _attend_range(
            q, m_i, l_i, acc, h, lo, tl.minimum(n_tail, lo + split), tq, d, d_ok, D,
            KX, KSC, KZP, KMU, KMUS, KLA, KLB, KOI, KOV,
            k_sh, k_sp, k_sb, k_sch, k_G, k_VG, k_lah, k_lbh, k_oh,
            VX, VSC, VZP, VMU, VMUS, VLA, VLB, VOI, VOV,
            v_sh, v_sp, v_sb, v_sch, v_G, v_VG, v_lah, v_lbh, v_oh,
            False, K_KIND, K_BITS, K_MU8, K_RANK, K_K2, V_KIND, V_BITS, V_MU8, V_RANK, V_K2,
            BLOCK_N, S_OUT, s_row, row_ok, 0, STORE_S, cap2, inv2, SOFTCAP)
    else:
        # -- the full-precision window, then the new tokens (query t sees new 0..t) -----------
        m_i, l_i, acc = _attend_fp(q, m_i, l_i, acc, h, W, tq, d, d_ok, D, KW, VW, sw_h, sw_t,
                                   False, BLOCK_N, S_OUT, s_row, row_ok, n_tail, STORE_S,
                                   cap2, inv2, SOFTCAP)
        m_i, l_i, acc = _attend_fp(q, m_i, l_i, acc, h, T, tq, d, d_ok, D, KN, VN, sn_h, sn_t,
                                   True, BLOCK_N, S_OUT, s_row, row_ok, n_tail + W, STORE_S,
                                   cap2, inv2, SOFTCAP)
    # -- this part's normalized output and log-sum-exp (rows that saw no token: lse -inf) ----
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    part = sp * tl.num_programs(0) + h
    tl.store(MID_O + (part * R + rows)[:, None] * D + d[None, :], o,
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(MID_L + part * R + rows, lse, mask=row_ok)


@triton.jit
def merge_part(m, l, acc, lse, o):
    """One split-K part folded into a running log-sum-exp merge (base 2): m the running max,
    l the running sum of weights, acc the weighted sum of the parts' outputs o, lse each
    row's log-sum-exp in that part (-inf where the row has none). Returns (m, l, acc)."""
    m_new = tl.maximum(m, lse)
    a = tl.exp2(m - m_new)
    w = tl.exp2(lse - m_new)
    return m_new, l * a + w, acc * a[:, None] + o * w[:, None]


@triton.jit
def _stage2_kernel(MID_O, MID_L,                                        # (P, Hkv, R, D), (P, Hkv, R)
                   O, so_h, so_t, so_d,                                 # (1, H, T, D)
                   n_parts, T, Gq, R, D,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                   WRITE_LSE: tl.constexpr = False):
    """Grid (Hkv, cdiv(R, BLOCK_R)); reads n_parts * BLOCK_R * (BLOCK_D + 1) fp32 partials,
    writes BLOCK_R * D outputs (Llama-3.1-70B, 32k: 34 parts, 1.1 MiB read in all).
    WRITE_LSE: also the rows' final log-sum-exp (base 2), into MID_L's part n_parts."""
    h = tl.program_id(0)
    Hkv = tl.num_programs(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    d = tl.arange(0, BLOCK_D)
    msk = row_ok[:, None] & (d < D)[None, :]
    m = tl.full((BLOCK_R,), -1.0e30, tl.float32)
    l = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    # -- log-sum-exp merge of the parts ---------------------------------------------------------
    for p in range(n_parts):
        part = p * Hkv + h
        lse = tl.load(MID_L + part * R + rows, mask=row_ok, other=float("-inf"))
        o = tl.load(MID_O + (part * R + rows)[:, None] * D + d[None, :], mask=msk, other=0.0)
        m, l, acc = merge_part(m, l, acc, lse, o)
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    if WRITE_LSE:
        tl.store(MID_L + (n_parts * Hkv + h) * R + rows, m + tl.log2(l), mask=row_ok)
    op = O + (h * Gq + rows // T)[:, None] * so_h + (rows % T)[:, None] * so_t + d[None, :] * so_d
    tl.store(op, out.to(O.dtype.element_ty), mask=msk)


@triton.jit
def _mass_kernel(S, LSE,                                                # (Hkv, R, N), (Hkv, R) fp32
                 MASS, sm_h,                                            # (H, N) fp32
                 T, Gq, R, N, mass_from,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """Attention mass: grid (Hkv, cdiv(N, BLOCK_N)). For each query head h·Gq + g of the
    group and each token n of the block: mass += Σ_{t >= mass_from} 2^(s[(g, t), n] − lse),
    the exact probabilities of the whole row (stage 1's logits, stage 2's log-sum-exp).
    Reads Gq·(T − mass_from)·BLOCK_N·4 bytes of logits, read-modify-writes Gq·BLOCK_N·4 of
    mass; each mass element belongs to one program."""
    h = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    for g in range(Gq):
        tot = tl.zeros((BLOCK_N,), tl.float32)
        for t0 in range(mass_from, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            t_ok = t < T
            r = h * R + g * T + t                                       # rows (g, t)
            lse = tl.load(LSE + r, mask=t_ok, other=0.0)
            s = tl.load(S + r[:, None] * N + n[None, :], mask=t_ok[:, None] & n_ok[None, :],
                        other=float("-inf"))
            tot += tl.sum(tl.exp2(s - lse[:, None]), 0)
        mp = MASS + (h * Gq + g) * sm_h + n
        tl.store(mp, tl.load(mp, mask=n_ok, other=0.0) + tot, mask=n_ok)


# -- launcher ------------------------------------------------------------------------------------

def supports(codec) -> bool:
    """True if the kernel reads this codec's storage (else the caller must use torch)."""
    return covers("decode_attention", "triton", codec) and (codec.kind != "gear" or codec.rank >= 1)


def _codec_args(codec, st: dict, D: int):
    """(9 tensors, 9 ints, (KIND, BITS, MU8, RANK, K2)) for dequant_tile."""
    kind = _KINDS[codec.kind]
    if kind == FP:
        return _fp_args(st["x"])
    x = st["codes"]
    assert all(t.is_contiguous() for t in st.values()), f"{codec}: storage must be contiguous"
    sc, zp = st.get("scale"), st.get("zero", st["scale"])
    mu, mus = st.get("mu", x), st.get("mu_scale", x)
    la, lb = st.get("lr_a", x), st.get("lr_b", x)
    oi, ov = st.get("out_idx", x), st.get("out_val", x)
    # nibble (Hkv, planes, blocks, ·, 32): strides (head, plane, block); chanpack K bytes
    # (Hkv, D, S*b/8): (head, channel)
    assert x.dtype == torch.uint8 and x.dim() in (3, 5), f"{codec}: unknown code layout {x.shape}"
    s_p, s_b = (x.stride(1), x.stride(2)) if x.dim() == 5 else (0, x.stride(1))
    ints = [x.stride(0), s_p, s_b, sc.stride(0), codec.G, getattr(codec, "g", 1),
            la.stride(0), lb.stride(0), oi.stride(0)]
    if "hi" in st:            # 3-bit KIVI keys: the third bits' planes in MU's place (dequant_tile)
        mu = st["hi"]
        ints[6:8] = mu.stride()[:2]
    bits = 8 if kind == INT8 else codec.bits
    mu8 = kind == TADA and codec.mu == "int8"
    rank = codec.rank if kind == GEAR else 0
    k2 = 2 * codec.outliers_per_row(D) if kind == GEAR and codec.sparsity else 0
    return [x, sc, zp, mu, mus, la, lb, oi, ov], ints, (kind, bits, mu8, rank, k2)


def _fp_args(x: torch.Tensor):
    """A (Hkv, S, D) full-precision tensor (channel stride 1) as an FP 'codec'."""
    assert x.stride(-1) == 1, "full-precision K/V need a unit channel stride"
    return [x] * 9, [x.stride(0), 0, x.stride(1), 0, 1, 1, 0, 0, 0], (FP, 16, False, 0, 0)


def _n_splits(n: int, Hkv: int, split: int | None) -> tuple[int, int]:
    if split is None:
        want = max(1, min(-(-TARGET_PROGRAMS // Hkv), -(-n // BLOCK_N)))
        split = -(-(-(-n // want)) // BLOCK_N) * BLOCK_N
    assert split > 0 and split % BLOCK_N == 0, f"split {split} must be a multiple of {BLOCK_N}"
    return -(-n // split), split


def bytes_per_step(k_codec, v_codec, H: int, Hkv: int, D: int, n_tail: int, W: int,
                   T: int = 1, act_bytes: int = 2, split: int | None = None) -> dict[str, float]:
    """Memory traffic of one decode_attention call by item (bytes): the roofline of this
    kernel. Tail: every packed byte once (codec.bytes_per_token, exact; TaDA's μ counted
    once per token — see the module docstring). Window: fp16/bf16 K and V. io: q, new K/V
    and the output at `act_bytes` each. parts: stage 1 writes and stage 2 reads the fp32
    (o, lse) of every (part, KV head, row)."""
    R = (H // Hkv) * T
    n_parts = (_n_splits(n_tail, Hkv, split)[0] if n_tail else 0) + 1  # + window/new part
    return {"tail_k": n_tail * sum(k_codec.bytes_per_token(Hkv, D).values()),
            "tail_v": n_tail * sum(v_codec.bytes_per_token(Hkv, D).values()),
            "window": 2.0 * W * Hkv * D * 2,
            "io": float(act_bytes * D * T * (2 * H + 2 * Hkv)),
            "parts": 2.0 * n_parts * Hkv * R * (D + 1) * 4}


def decode_attention(q: torch.Tensor, k_tail, v_tail, n_tail: int,
                     k_win: torch.Tensor, v_win: torch.Tensor,
                     k_new: torch.Tensor, v_new: torch.Tensor,
                     block: int | None = None, q_chunk: int | None = None,
                     split: int | None = None, mass: torch.Tensor | None = None,
                     mass_from: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of new queries over [tail, window, new tokens] (Triton).

    Shapes and semantics as kernels.decode_attention.decode_attention: q (1, H, T, D);
    k_tail / v_tail (codec, storage) holding n_tail tokens; k_win, v_win (1, Hkv, W, D);
    k_new, v_new (1, Hkv, T, D). Returns (1, H, T, D) in q's dtype. `block` and `q_chunk`
    (the torch path's CPU tiling) are accepted and ignored; `split` = tokens per stage-1
    program (a multiple of 32; default: ~264 programs over the tail).
    mass: optional float32 (H, n_tail + W + T), += the attention probabilities of queries
    t >= mass_from summed over those queries, per query head (as the torch path): stage 1
    then also writes its logits (Hkv, R, N) fp32, stage 2 the rows' log-sum-exp, and a third
    launch (`_mass_kernel`) turns them into probabilities. softcap > 0: the logits
    soft-capped to softcap·tanh(s / softcap) (the module docstring)."""
    B, H, T, D = q.shape
    Hkv = k_new.shape[1]
    if B != 1:
        raise ValueError(f"decode_attention: batch 1 only, got q {tuple(q.shape)}")
    if H % Hkv:
        raise ValueError(f"decode_attention: H={H} is not a multiple of Hkv={Hkv}")
    if k_new.shape != (1, Hkv, T, D) or v_new.shape != (1, Hkv, T, D):
        raise ValueError(f"new K/V {tuple(k_new.shape)} / {tuple(v_new.shape)} != (1, {Hkv}, {T}, {D})")
    if k_win.shape[:2] != (1, Hkv) or k_win.shape != v_win.shape or k_win.shape[3] != D:
        raise ValueError(f"window K/V {tuple(k_win.shape)} / {tuple(v_win.shape)} mismatch")
    for c, _ in (k_tail, v_tail):
        if n_tail and not supports(c):
            raise ValueError(f"the Triton decode_attention does not read {c} (use the torch path)")
    if D > 256:
        raise ValueError(f"head dim {D} > 256 is not supported by the Triton kernel")
    N = n_tail + k_win.shape[2] + T
    if mass is not None and (mass.shape != (H, N) or mass.dtype != torch.float32
                             or mass.stride(1) != 1):
        raise ValueError(f"mass {tuple(mass.shape)} {mass.dtype} must be ({H}, {N}) float32 "
                         "with unit token stride")
    grid, args, cx, n_parts = _plan(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, split,
                                    softcap)
    R = (H // Hkv) * T
    want_mass = mass is not None and mass_from < T
    mid_o = torch.empty(n_parts, Hkv, R, D, dtype=torch.float32, device=q.device)
    mid_l = torch.empty(n_parts + want_mass, Hkv, R, dtype=torch.float32, device=q.device)
    s_out = torch.empty(Hkv, R, N, dtype=torch.float32, device=q.device) if want_mass else None
    out = torch.empty(1, H, T, D, dtype=q.dtype, device=q.device)
    _stage1_kernel[grid](*args(mid_o, mid_l, s_out), **cx, STORE_S=want_mass, SOFTCAP=softcap > 0)
    cx2 = _stage2_config(R, D)
    _stage2_kernel[(Hkv, triton.cdiv(R, cx2["BLOCK_R"]))](
        mid_o, mid_l, out, out.stride(1), out.stride(2), out.stride(3), n_parts, T, H // Hkv, R, D,
        **cx2, WRITE_LSE=want_mass)
    if want_mass:
        _mass_kernel[(Hkv, triton.cdiv(N, MASS_BLOCK_N))](
            s_out, mid_l[n_parts], mass, mass.stride(0), T, H // Hkv, R, N, max(0, mass_from),
            BLOCK_T=min(16, triton.next_power_of_2(T)), BLOCK_N=MASS_BLOCK_N, num_warps=4)
    return out


def softcap_args(softcap: float) -> tuple[float, float]:
    """(cap2, inv2) of `softcap_logits` for a soft-cap (unused values when it is 0)."""
    return (softcap * LOG2E, 2.0 / softcap) if softcap > 0 else (1.0, 1.0)


def _stage2_config(R: int, D: int) -> dict:
    return dict(BLOCK_R=min(32, max(16, triton.next_power_of_2(R))),
                BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=4)


def _plan(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, split, softcap=0.0):
    """The stage-1 launch: (grid, args(mid_o, mid_l) -> argument list, constexprs, n_parts).
    Parts: n_split tail splits, then one window + new tokens part."""
    _, H, T, D = q.shape
    Hkv, W = k_new.shape[1], k_win.shape[2]
    Gq = H // Hkv
    R = Gq * T
    kn = k_new[0] if k_new.stride(-1) == 1 else k_new[0].contiguous()   # (Hkv, T, D)
    vn = v_new[0] if v_new.stride(-1) == 1 else v_new[0].contiguous()
    kw = k_win[0] if k_win.stride(-1) == 1 else k_win[0].contiguous()   # (Hkv, W, D)
    vw = v_win[0] if v_win.stride(-1) == 1 else v_win[0].contiguous()
    if vw.stride() != kw.stride() or vn.stride() != kn.stride():
        kw, vw, kn, vn = kw.contiguous(), vw.contiguous(), kn.contiguous(), vn.contiguous()
    (kc, ks), (vc, vs) = k_tail, v_tail
    n_split, sz = _n_splits(n_tail, Hkv, split) if n_tail else (0, BLOCK_N)
    kt, ki, kk = _codec_args(kc, ks, D) if n_tail else _fp_args(kn)
    vt, vi, vk = _codec_args(vc, vs, D) if n_tail else _fp_args(vn)
    # dequantization holds more tiles in registers than a plain fp16 read, and GEAR's
    # low-rank and outlier terms more again: smaller tiles keep sm_90 from spilling
    gear = n_tail and "gear" in (kc.kind, vc.kind)
    packed = n_tail and not (kc.kind == "fp" and vc.kind == "fp")
    block_r = min(32 if packed else 64, max(16, triton.next_power_of_2(R)))
    cx = dict(K_KIND=kk[0], K_BITS=kk[1], K_MU8=kk[2], K_RANK=kk[3], K_K2=kk[4],
              V_KIND=vk[0], V_BITS=vk[1], V_MU8=vk[2], V_RANK=vk[3], V_K2=vk[4],
              BLOCK_R=block_r, BLOCK_N=16 if gear else BLOCK_N,
              BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=NUM_WARPS if D > 64 else 4)

    def args(mid_o, mid_l, s_out=None):
        return [q, q.stride(1), q.stride(2), q.stride(3), *kt, *ki, *vt, *vi,
                kw, vw, kw.stride(0), kw.stride(1), kn, vn, kn.stride(0), kn.stride(1),
                mid_o, mid_l, mid_o if s_out is None else s_out, n_tail, n_split, sz, W, T, Gq, R, D,
                D ** -0.5 * LOG2E, *softcap_args(softcap)]
    return (Hkv, n_split + 1, triton.cdiv(R, block_r)), args, cx, n_split + 1
