"""ring_step, Triton: one decode token of a quantized sliding-window ring (Gemma 3's local
layers, runtime/kv/ring.py) — attention over the ring's codes read in place, dequantized in
registers, and the new K/V rows quantized into their slot. Same signature and semantics as
kernels/native/ring_attention.py `ring_step` (the native CPU kernel); its oracle is the
torch step, `SlidingWindowKV._attend` with T == 1 followed by `unrotate`.

Storage (`_RingStore`): per role, codes (L, Hkv, W, D·bits/8) uint8 — 8 bits one byte per
channel, 4 bits the channel pair (2i, 2i+1) in byte i (low nibble 2i) — and fp16 scale and
min (L, Hkv, W, D/group). Row x of a slot: per group of `group` channels, scale and min
from the fp32 min/max by kernels/quant.py's asym_params (kivi_pack._asym_params), code =
clamp(round_half_even((x − min)/scale), 0, top), NaN → 0 (torch's uint8 cast of a NaN).

Two launches:
- `_stage1_kernel`, grid (Hkv, n_split): program (h, sp) takes the Gq query heads of KV
  head h (one BLOCK_R tile, so the heads sharing a KV head share every tile load) over the
  slots [sp·split, min(n, (sp+1)·split)), BLOCK_N slots a tile: K and V codes and their
  scale/min loaded once, dequantized in registers (c·s + m), s = q·k̂ᵀ (fp32 accumulate),
  online softmax in fp32 (base 2, log2 e folded into q's scale), acc += p·V̂. A 4-bit tile
  is kept as its low and high nibbles (channels 2i and 2i+1: q and the accumulator are
  split the same way, two dots of D/2), so no nibble is shuffled. Slot `slot` is not read
  from the codes: the new row, rounded to the ring dtype, stands in for it in full
  precision (as the torch step attends it). Program (h, 0) also quantizes head h's new K and
  V rows into slot `slot`: bytes no program reads, so one launch both reads and writes.
  Writes each part's normalized output and log-sum-exp (fp32).
- `_stage2_kernel`, grid (Hkv,): merges the parts by log-sum-exp and, with rotate_v,
  un-rotates (o·R_vᵀ, fp32 dots over BLOCK_E-column chunks of R_v); writes (1, H, 1, D) in
  q's dtype.
Blocks: BLOCK_N = 32 slots, BLOCK_C = the row's code bytes (D·bits/8) to a power of two,
BLOCK_R = Gq to a power of two, at least 16 (tl.dot's smallest tile); 8 warps (4 at
D <= 64). Compiled for sm_90 with triton's bundled ptxas, D 64-256, Gq 2-16, 4 and 8 bits:
153-233 registers, no spills (Gq 32 at D 256 spills, hence MAX_GQ).
Split: slots per part = max(SPLIT_MIN, n / ⌈TARGET/Hkv⌉) in whole BLOCK_N tiles: Gemma 3
270M's ring (Hkv 1, W 512) takes 4 parts; the 16-slot and 37-slot rings of the tests one.

Bytes per decode step and layer (`bytes_per_step`): read — the codes, scales and mins of
the n − 1 old slots of K and V once each, 2·Hkv·(n − 1)·(D·bits/8 + 4·D/group) (the scale
and min loads repeat per channel of a group within a tile: L1 hits, one DRAM sector per
slot); q H·D and the new rows 2·Hkv·D at their dtype's size (re-read by each part, from
L2); the parts, written by stage 1 and read by stage 2, 2·n_split·H·(D + 1)·4; with
rotate_v R_v, 4·D² (the same matrix for every layer: L2-resident after the first).
Written — the new slot, 2·Hkv·(D·bits/8 + 4·D/group), and the output H·D. Gemma 3 270M
(H 4, Hkv 1, D 256, group 32, 4 bits, fp16 rows) at n = 512: 159.7 KiB of ring (against
512 KiB for its fp16 ring), 32.1 KiB of parts, 256 KiB of R_v from L2; no dequantized copy.

Bit-identical storage on GPU: IEEE division (div_rn), fp16 conversions round to nearest
even, codes round half to even by the 1.5·2^23 trick (exact for |v| < 2^22; larger |v|
clamp to 0 or top either way), bf16 ring rows rounded on the bits (rounding._rnd).
The quantizer has no multiply, so FMA contraction (left on for the attention math) cannot
change a stored bit. Caveat shared with the C kernel: a group whose minimum is a zero of
both signs may store either sign of min (torch's amin picks by its reduction order).

Precision: dequantization, softmax and accumulation in fp32; on GPU the attention dots take
fp32 operands as tf32 (as triton/decode_attention.py; the 10-bit mantissa the torch step's
SDPA rounds q and the rows to on an fp16 ring), the un-rotation is an IEEE fp32 dot; the
interpreter computes exact fp32.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .rounding import XDT_CODES, _rhe, _rnd
from .decode_attention import merge_part, softcap_args, softcap_logits
from .kivi_pack import _asym_params

MAX_D, MAX_GQ = 256, 16         # Gq 32 at D 256 would spill registers on sm_90
BLOCK_N = 32                    # slots per tile, split granularity
SPLIT_MIN = 128                 # slots per part at least: parts cost ~20% of the ring's bytes
TARGET_PROGRAMS = 264           # 2 per SM of an H100 (132 SMs)
BLOCK_E = 32                    # output columns per un-rotation dot
LOG2E = 1.4426950408889634


@triton.jit
def _quant_store(xa, xb, j, da, db, ok, CODES, SC, MN, NG,
                 BITS: tl.constexpr, GROUP: tl.constexpr):
    """Quantize one row into its slot, bit-identical to _RingStore.write. 8 bits: xa the
    row at channels da = j (xb unused); 4 bits: xa / xb the even / odd channels da = 2j,
    db = 2j + 1 of byte j. CODES / SC / MN point at the slot's codes, scales and mins."""
    TOP: tl.constexpr = (1 << BITS) - 1
    sa = tl.zeros_like(xa) + 1.0                    # padded channels (never stored): x / 1
    ma = tl.zeros_like(xa)
    sb = tl.zeros_like(xb) + 1.0
    mb = tl.zeros_like(xb)
    for gi in range(NG):
        ia = ok & (da // GROUP == gi)
        lo = tl.min(tl.where(ia, xa, float("inf")), 0)
        hi = tl.max(tl.where(ia, xa, float("-inf")), 0)
        if BITS == 4:
            ib = ok & (db // GROUP == gi)
            lo = tl.minimum(lo, tl.min(tl.where(ib, xb, float("inf")), 0))
            hi = tl.maximum(hi, tl.max(tl.where(ib, xb, float("-inf")), 0))
        sc, mn = _asym_params(lo, hi, TOP)
        tl.store(SC + gi, sc)
        tl.store(MN + gi, mn)
        sa = tl.where(da // GROUP == gi, sc.to(tl.float32), sa)
        ma = tl.where(da // GROUP == gi, mn.to(tl.float32), ma)
        if BITS == 4:
            sb = tl.where(db // GROUP == gi, sc.to(tl.float32), sb)
            mb = tl.where(db // GROUP == gi, mn.to(tl.float32), mb)
    c = _code(xa, sa, ma, TOP)
    if BITS == 4:
        c = c | (_code(xb, sb, mb, TOP) << 4)
    tl.store(CODES + j, c.to(tl.uint8), mask=ok)


@triton.jit
def _code(x, s, m, TOP: tl.constexpr):
    """clamp(round_half_even((x − m) / s), 0, TOP) as int32; NaN → 0."""
    r = _rhe(tl.math.div_rn(x - m, s))
    r = tl.where(r != r, 0.0, tl.minimum(tl.maximum(r, 0.0), TOP * 1.0))
    return r.to(tl.int32)


@triton.jit
def _deq(CODES, SC, MN, t, j, msk, c_t, s_t, BITS: tl.constexpr, GROUP: tl.constexpr):
    """Dequantized (BN, BC) tiles of slots t at byte columns j: 8 bits (channel j, same);
    4 bits (channels 2j, 2j + 1)."""
    c = tl.load(CODES + t[:, None] * c_t + j[None, :], mask=msk, other=0).to(tl.int32)
    if BITS == 4:
        pa = t[:, None] * s_t + ((2 * j) // GROUP)[None, :]
        sa = tl.load(SC + pa, mask=msk, other=0.0).to(tl.float32)
        ma = tl.load(MN + pa, mask=msk, other=0.0).to(tl.float32)
        if GROUP % 2 == 0:                              # a byte's two channels share a group
            sb, mb = sa, ma
        else:
            pb = t[:, None] * s_t + ((2 * j + 1) // GROUP)[None, :]
            sb = tl.load(SC + pb, mask=msk, other=0.0).to(tl.float32)
            mb = tl.load(MN + pb, mask=msk, other=0.0).to(tl.float32)
        return (c & 15).to(tl.float32) * sa + ma, (c >> 4).to(tl.float32) * sb + mb
    else:
        p = t[:, None] * s_t + (j // GROUP)[None, :]
        s = tl.load(SC + p, mask=msk, other=0.0).to(tl.float32)
        m = tl.load(MN + p, mask=msk, other=0.0).to(tl.float32)
        x = c.to(tl.float32) * s + m
        return x, x


@triton.jit
def _stage1_kernel(Q, sq_h,                                  # (H, D) rotated queries
                   KN, VN, skn_h, svn_h,                     # (Hkv, D) new rows
                   KC, KS, KM, VC, VS, VM,                   # ring storage (L, Hkv, W, ·)
                   c_l, c_h, c_t, s_l, s_h, s_t,             # its strides (K's = V's)
                   MID_O, MID_L,                             # (P, Hkv, Gq, D), (P, Hkv, Gq)
                   layer, slot, n, split, Gq, D, NG, qk_scale, cap2, inv2,
                   BITS: tl.constexpr, GROUP: tl.constexpr, RDT: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                   SOFTCAP: tl.constexpr = False):
    """Grid (Hkv, n_split); tiles (BLOCK_R query heads, BLOCK_N slots, BLOCK_C byte
    columns). Reads split·2·(D·bits/8 + 4·D/group) ring bytes, writes Gq·(D + 1)·4."""
    h = tl.program_id(0)
    sp = tl.program_id(1)
    Hkv = tl.num_programs(0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < Gq
    j = tl.arange(0, BLOCK_C)                                # byte column
    PER: tl.constexpr = 8 // BITS                            # channels per byte
    j_ok = j < D // PER
    da = PER * j                                             # its channel(s): da, da + 1
    db = da + 1
    qm = r_ok[:, None] & j_ok[None, :]
    qrow = Q + (h * Gq + r)[:, None] * sq_h
    qa = tl.load(qrow + da[None, :], mask=qm, other=0.0).to(tl.float32) * qk_scale
    qb = tl.load(qrow + db[None, :], mask=qm & (BITS == 4), other=0.0).to(tl.float32) * qk_scale
    # -- the new rows, rounded to the ring dtype (attended in full precision) ---------------
    kxa = _rnd(tl.load(KN + h * skn_h + da, mask=j_ok, other=0.0).to(tl.float32), RDT)
    kxb = _rnd(tl.load(KN + h * skn_h + db, mask=j_ok & (BITS == 4), other=0.0).to(tl.float32), RDT)
    vxa = _rnd(tl.load(VN + h * svn_h + da, mask=j_ok, other=0.0).to(tl.float32), RDT)
    vxb = _rnd(tl.load(VN + h * svn_h + db, mask=j_ok & (BITS == 4), other=0.0).to(tl.float32), RDT)
    base = layer * c_l + h * c_h
    pbase = layer * s_l + h * s_h
    if sp == 0:
        # -- ... and quantized into slot `slot`, which no program reads ---------------------
        _quant_store(kxa, kxb, j, da, db, j_ok, KC + base + slot * c_t, KS + pbase + slot * s_t,
                     KM + pbase + slot * s_t, NG, BITS, GROUP)
        _quant_store(vxa, vxb, j, da, db, j_ok, VC + base + slot * c_t, VS + pbase + slot * s_t,
                     VM + pbase + slot * s_t, NG, BITS, GROUP)
    m_i = tl.full((BLOCK_R,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc_a = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    acc_b = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    lo = sp * split
    hi = tl.minimum(n, lo + split)
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < hi
        new = (t == slot)[:, None]
        msk = (t_ok & (t != slot))[:, None] & j_ok[None, :]
        # -- K tile: codes dequantized in registers, the new slot from its row -------------
        ka, kb = _deq(KC + base, KS + pbase, KM + pbase, t, j, msk, c_t, s_t, BITS, GROUP)
        ka = tl.where(new, kxa[None, :], ka)
        s = tl.dot(qa, tl.trans(ka))                         # (BR, BN)
        if BITS == 4:
            kb = tl.where(new, kxb[None, :], kb)
            s += tl.dot(qb, tl.trans(kb))
        if SOFTCAP:                                          # Gemma 2: cap2·tanh(s / cap2)
            s = softcap_logits(s, cap2, inv2)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        # -- online softmax (fp32, base 2) -------------------------------------------------
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- V tile ------------------------------------------------------------------------
        va, vb = _deq(VC + base, VS + pbase, VM + pbase, t, j, msk, c_t, s_t, BITS, GROUP)
        va = tl.where(new, vxa[None, :], va)
        acc_a = acc_a * alpha[:, None] + tl.dot(p, va)
        if BITS == 4:
            vb = tl.where(new, vxb[None, :], vb)
            acc_b = acc_b * alpha[:, None] + tl.dot(p, vb)
        m_i = m_new
    # -- the part's normalized output (channel order) and log-sum-exp -----------------------
    seen = l_i > 0.0
    inv = 1.0 / tl.where(seen, l_i, 1.0)
    row = ((sp * Hkv + h) * Gq + r)
    orow = MID_O + row[:, None] * D
    tl.store(orow + da[None, :], acc_a * inv[:, None], mask=qm)
    if BITS == 4:
        tl.store(orow + db[None, :], acc_b * inv[:, None], mask=qm)
    tl.store(MID_L + row, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")),
             mask=r_ok)


@triton.jit
def _stage2_kernel(MID_O, MID_L, RV, sr_0, sr_1, O, so_h, n_parts, Gq, D,
                   ROT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    """Grid (Hkv,): merges the n_parts partial outputs of KV head h's query heads (reads
    n_parts·Gq·(D + 1)·4 bytes), un-rotates them by R_v (ROT: y = o·R_vᵀ, y_e = Σ_d o_d
    R_v[e, d]) and writes Gq·D outputs in O's dtype."""
    h = tl.program_id(0)
    Hkv = tl.num_programs(0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < Gq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    m = tl.full((BLOCK_R,), -1.0e30, tl.float32)
    l = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for p in range(n_parts):
        row = (p * Hkv + h) * Gq + r
        lse = tl.load(MID_L + row, mask=r_ok, other=float("-inf"))
        o = tl.load(MID_O + row[:, None] * D + d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                    other=0.0)
        m, l, acc = merge_part(m, l, acc, lse, o)
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    orow = O + (h * Gq + r)[:, None] * so_h
    if ROT:
        for e0 in range(0, D, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            e_ok = e < D
            rt = tl.load(RV + e[None, :] * sr_0 + d[:, None] * sr_1,
                         mask=d_ok[:, None] & e_ok[None, :], other=0.0)   # (BD, BE) R_v[e, d]
            y = tl.dot(out, rt, input_precision="ieee")
            tl.store(orow + e[None, :], y.to(O.dtype.element_ty), mask=r_ok[:, None] & e_ok[None, :])
    else:
        tl.store(orow + d[None, :], out.to(O.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


# -- launcher ------------------------------------------------------------------------------------

def _on_device(x: torch.Tensor) -> bool:
    """CUDA tensors, or CPU ones under Triton's interpreter."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def covers(H: int, Hkv: int, D: int, bits: int, group: int, dtype) -> bool:
    """Whether the kernel takes a ring of these shapes: 4- or 8-bit codes in channel groups
    dividing D, head dim <= 256 (even at 4 bits), at most 16 query heads per KV head, an
    fp16/bf16/fp32 ring dtype (kernels/backend.py resolves a ring's route from it)."""
    return (bits in (4, 8) and 0 < D <= MAX_D and group >= 1 and D % group == 0
            and (bits == 8 or D % 2 == 0) and H % Hkv == 0 and H // Hkv <= MAX_GQ
            and dtype in XDT_CODES)


def supports(q, k, v, k_parts, v_parts, bits: int, group: int, dtype) -> bool:
    """Whether the kernel covers this step: one token of batch 1 on the kernel's device, a
    ring `covers` takes, fp16/bf16/fp32 channel-contiguous q/k/v, K and V storage of one
    layout."""
    _, H, T, D = q.shape
    if not (T == 1 and q.shape[0] == 1 and _on_device(q)
            and covers(H, k.shape[1], D, bits, group, dtype)):
        return False
    if not all(x.dtype in XDT_CODES and x.stride(3) == 1 and x.device == q.device for x in (q, k, v)):
        return False
    codes, sc, mn = k_parts
    return (len(v_parts) == 3 and all(a.stride() == b.stride() and a.device == q.device
                                      for a, b in zip(k_parts, v_parts))
            and codes.dtype == torch.uint8 and sc.dtype == mn.dtype == torch.float16
            and codes.stride(3) == 1 and sc.stride(3) == 1 and sc.stride() == mn.stride()
            and codes.shape[3] == D * bits // 8 and sc.shape[3] == D // group)


def n_splits(n: int, Hkv: int, split: int | None = None) -> tuple[int, int]:
    """(parts, slots per part) of an n-slot step: SPLIT_MIN slots a part at least, else
    about TARGET_PROGRAMS programs in all, in whole BLOCK_N tiles."""
    if split is None:
        split = max(SPLIT_MIN, -(-n // -(-TARGET_PROGRAMS // Hkv)))
    split = -(-split // BLOCK_N) * BLOCK_N
    return -(-n // split), split


def bytes_per_step(H: int, Hkv: int, D: int, n: int, bits: int, group: int,
                   rotate_v: bool = False, act_bytes: int = 2) -> dict[str, float]:
    """Memory traffic of one ring_step by item, in bytes (the module docstring's count)."""
    slot = D * bits // 8 + 4 * D // group
    return {"ring": 2.0 * Hkv * (n - 1) * slot, "slot_write": 2.0 * Hkv * slot,
            "io": float(act_bytes * D * (2 * H + 2 * Hkv)),
            "parts": 2.0 * n_splits(n, Hkv)[0] * H * (D + 1) * 4,
            "rot_v": 4.0 * D * D if rotate_v else 0.0}


def ring_step(q, k, v, k_parts, v_parts, bits: int, group: int, dtype, layer: int, slot: int,
              n: int, rot_v=None, split: int | None = None, softcap: float = 0.0):
    """One decode token of a quantized ring layer, as kernels/native/ring_attention.py
    `ring_step`: q (1, H, 1, D) and k (1, Hkv, 1, D) rotated by the ring's K rotation, v
    (1, Hkv, 1, D) rotated by rot_v (the ring's hadamard.Hadamard) when given; k_parts /
    v_parts the (codes, scale, min) tensors of every sliding layer, (L, Hkv, W, ·); dtype
    the ring's row dtype (the new rows are rounded to it). Writes the new rows into `slot` of `layer`, attends over slots
    0 .. n-1 (slot `slot` the new rows in full precision) and returns (1, H, 1, D) in q's
    dtype, un-rotated by rot_v. None when not covered (the caller runs the torch step).
    `split`: slots per stage-1 part (default `n_splits`). softcap > 0: the logits
    soft-capped to softcap·tanh(s / softcap) before the softmax."""
    if not supports(q, k, v, k_parts, v_parts, bits, group, dtype) or not 0 <= slot < n:
        return None
    _, H, _, D = q.shape
    Hkv = k.shape[1]
    Gq = H // Hkv
    W = k_parts[0].shape[2]
    assert n <= W and 0 <= layer < k_parts[0].shape[0], (n, W, layer)
    P, sz = n_splits(n, Hkv, split)
    kc, ks, km = k_parts
    vc, vs, vm = v_parts
    mid_o = torch.empty(P, Hkv, Gq, D, dtype=torch.float32, device=q.device)
    mid_l = torch.empty(P, Hkv, Gq, dtype=torch.float32, device=q.device)
    out = torch.empty(1, H, 1, D, dtype=q.dtype, device=q.device)
    block_r = max(16, triton.next_power_of_2(Gq))
    _stage1_kernel[(Hkv, P)](
        q, q.stride(1), k, v, k.stride(1), v.stride(1), kc, ks, km, vc, vs, vm,
        *kc.stride()[:3], *ks.stride()[:3], mid_o, mid_l, layer, slot, n, sz, Gq, D,
        D // group, LOG2E / math.sqrt(D), *softcap_args(softcap),
        BITS=bits, GROUP=group, RDT=XDT_CODES[dtype], BLOCK_R=block_r, BLOCK_N=BLOCK_N,
        SOFTCAP=softcap > 0,
        BLOCK_C=max(16, triton.next_power_of_2(D * bits // 8)), num_warps=4 if D <= 64 else 8)
    rv = None if rot_v is None else rot_v.matrix     # (D, D) fp32 form: one dot per output
    _stage2_kernel[(Hkv,)](
        mid_o, mid_l, rv if rv is not None else mid_o, *(rv.stride() if rv is not None else (0, 0)),
        out, out.stride(1), P, Gq, D, ROT=rv is not None, BLOCK_R=block_r,
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_E=BLOCK_E, num_warps=4)
    return out
