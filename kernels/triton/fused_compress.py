"""rope_compress_k and vproj_compress, Triton (kernels/dispatch.py): one launch per layer per
call computes the new K rows with RoPE (or the new V rows with the V projection, or takes
V rows as given when the model's v_proj is weight-quantized), appends them to the residual
window, and packs the tokens that leave the window into the codec's tail storage straight
from registers — bit-identical to `codec.pack` of the same rows (the torch oracle:
kernels/fused_compress.py; window semantics of KVArena.append). The arena's decode step
calls them through kernels/dispatch.py (runtime/kv/arena.py `attend_new`) with
flush=False: its contract attends before it flushes, so there the launch only writes the
new rows and the flush follows the attention as a `pack` (`kivi_pack` for KIVI). The
in-launch flush serves appends with no attention in between, and its bytes are pinned bit
for bit against the oracle (tests/kernels/test_triton_compress.py).

Codecs: KIVI (2/4/8-bit; K per channel over G-token groups in chanpack.py's byte planes,
V per token over g-channel groups in nibble.py's channel-major layout), TaDA (2/4/8-bit
deviations, μ over the KV heads in fp16 or int8 words) and int8, each as K (token-major
nibbles for TaDA / int8) or V (channel-major). Rounding is torch's: IEEE division (div_rn),
round-half-even (the 1.5·2^23 trick), fp32 → fp16 round-to-nearest-even, μ as the
sequential sum over heads divided by Hkv (what torch's mean does for these shapes), and no
fused multiply-add (`enable_fp_fusion=False` on GPU). RoPE in fp16/bf16 rounds after each
operation like torch's CPU half arithmetic. Exception: vproj_compress's projection is a
tiled fp32 dot product whose summation order differs from torch's GEMM, so its rows (and
then codes at rounding boundaries) match torch only where the matmul is exact — the
packing of the rows it computes is bit-exact (tests: dyadic inputs, exact products).

`_fused_kernel`, grid (1 + units of new tokens only, heads axis): the tail tokens being
flushed, [n_tail, n_tail + f), are cut into units of U = max(G, storage block) tokens
(storage blocks: chanpack 32·8/bits, token-major nibbles 64 or 128 for 2 bits, channel-
major 64), so one program owns every byte, scale and μ word it writes and read-modify-
writes bytes a previous flush half filled. Program 0 owns the units that hold window
tokens and, after a barrier, rewrites the window (compaction after a flush: a window
token is read by the flush and by the move, both in this program); the other programs
pack units made of new tokens only (a prefill chunk) in parallel. Heads axis: Hkv programs
for per-head codecs (KIVI, int8), 1 for TaDA (μ needs every head of a token; its program
writes μ, barriers, and reads μ̂ back for the deviations). Blocks: BLOCK_D = next power of
two >= D (>= 64 for the channel-major layout), runs of 32 tokens, BLOCK_K = 32 hidden
channels per dot step (vproj), 4 warps.

Bytes per decode step (T = 1; fp16 window; Llama-3.1-70B: Hkv 8, D 128, hidden 8192,
G 32), see `bytes_per_step`: without a flush, K reads the new row and its cos/sin (2 KiB
+ 0.5 KiB) and writes 2 KiB of window; V reads x (16 KiB) and Wv (16 MiB: the projection's
weight dominates) and writes 2 KiB. On a flush (every G steps) it also reads the whole
window (R + G − 1 = 159 tokens: 318 KiB), writes the compacted window (R = 128 tokens:
256 KiB) and the packed block (kivi-4 K: 16 KiB codes + 4 KiB scale/zero; tada-4 K: 16 KiB
codes + 1 KiB scale/zero + 8 KiB μ). tools/roofline.py prints these per step, averaged
over the G steps of a flush cycle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fused_compress import flush_count, supports  # supports: the codecs both backends fuse
from .compress_units import _rows, _tada_mu, _unit_chan, _unit_chanpack, _unit_tok

INT8, KIVI, TADA = 1, 2, 3
NUM_WARPS = 4
BLOCK_K = 32


@triton.jit
def _fused_kernel(WIN, sw_h, sw_t,                       # (Hkv, R+G, D) window, w tokens
                  X, sx_h, sx_t,                         # K: (Hkv, T, D); V: (T, KH)
                  A, B, s_a, KH,                         # K: cos, sin (T, D); V: Wv (Hkv·D, KH), bias
                  CODES, c_h, c_p, c_b,                  # codec storage (layout per KIND / V)
                  SC, ZP, sc_h, MU, MUS,
                  w, T, f, n_tail, Hkv, u_first, n_win_units, D,
                  KIND: tl.constexpr, V: tl.constexpr, BITS: tl.constexpr, MU8: tl.constexpr,
                  G: tl.constexpr, U: tl.constexpr, NG: tl.constexpr, VG: tl.constexpr,
                  SRC: tl.constexpr, XDT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  ALL_HEADS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (1 + units of new tokens, 1 if ALL_HEADS else Hkv). Program 0: the units
    holding window tokens, then the window; program p > 0: unit u_first + n_win_units + p − 1."""
    p = tl.program_id(0)
    if ALL_HEADS:
        h_lo, h_hi = 0, Hkv
    else:
        h_lo = tl.program_id(1)
        h_hi = h_lo + 1
    if p == 0:
        u_lo, u_hi = u_first, u_first + n_win_units
    else:
        u_lo = u_first + n_win_units + p - 1
        u_hi = u_lo + 1
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    for u in range(u_lo, u_hi):
        # -- pack the unit's flushed tokens --------------------------------------------------
        if KIND == 3:
            for gg in tl.static_range(U // G):
                t0 = u * U + gg * G
                if (t0 >= n_tail) & (t0 < n_tail + f):
                    _tada_mu(t0, n_tail, Hkv, d, d_ok, MU, MUS, D, WIN, sw_h, sw_t, w,
                             X, sx_h, sx_t, A, B, s_a, KH, G, MU8, SRC, XDT, HAS_BIAS, BLOCK_K)
            tl.debug_barrier()                   # μ̂ is read back by every head's deviations
        for h in range(h_lo, h_hi):
            if V:
                _unit_chan(u, h, n_tail, f, CODES, c_h, c_p, c_b, SC, ZP, sc_h, MU, MUS, D,
                           WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B, s_a, KH,
                           KIND, BITS, MU8, G, U, NG, VG, SRC, XDT, HAS_BIAS, BLOCK_D, BLOCK_K)
            elif KIND == 2:
                _unit_chanpack(u, h, n_tail, f, d, d_ok, CODES, c_h, c_b, SC, ZP, sc_h, D,
                               WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B, s_a, KH,
                               BITS, G, U, SRC, XDT, HAS_BIAS, BLOCK_K)
            else:
                _unit_tok(u, h, n_tail, f, d, d_ok, CODES, c_h, c_p, c_b, SC, ZP, sc_h, MU,
                          MUS, D, WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B, s_a, KH,
                          KIND, BITS, MU8, G, U, SRC, XDT, HAS_BIAS, BLOCK_K)
    if p == 0:
        # -- the window: kept tokens move to the front (after a flush), new rows appended ---
        tl.debug_barrier()                       # the flush above read window slots [0, f)
        start = tl.where(f == 0, w, f)
        for h in range(h_lo, h_hi):
            for c0 in range(start, w + T, 32):
                i = c0 + tl.arange(0, 32)
                ok = i < w + T
                y = _rows(h, i, ok, d, WIN, sw_h, sw_t, w, X, sx_h, sx_t, A, B, s_a, KH, D,
                          SRC, XDT, HAS_BIAS, BLOCK_K)
                tl.debug_barrier()               # slots [c0 − f, ..) may be read above
                tl.store(WIN + h * sw_h + (i - f)[:, None] * sw_t + d[None, :],
                         y.to(WIN.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


# -- launchers -----------------------------------------------------------------------------

_XDT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _unit(codec) -> int:
    """Tokens per unit: whole G groups and whole storage blocks (both powers of two)."""
    if codec.role == "v":
        blk = 64
    elif codec.kind == "kivi":
        blk = 32 * (8 // codec.bits)
    else:
        blk = 128 if getattr(codec, "bits", 8) == 2 else 64
    return max(codec.G, blk)


def _launch(SRC, rows_dtype, T, x, sx_h, sx_t, a, b, s_a, KH, has_bias,
            win, w, codec, st, n_tail, R, flush=True) -> int:
    if not supports(codec):
        raise ValueError(f"fused compress: {codec} is not a KIVI / TaDA / int8 codec with a "
                         "power-of-two G >= 32")
    Hkv, slots, D = win.shape
    G = codec.G
    if win.stride(-1) != 1 or slots != R + G:
        raise ValueError(f"window {tuple(win.shape)} must be (Hkv, R+G={R + G}, D) with unit channel stride")
    if n_tail % G:
        raise ValueError(f"n_tail {n_tail} is not a multiple of G={G}")
    if not 0 <= w < R + G:
        raise ValueError(f"window holds {w} tokens, more than R+G-1={R + G - 1}")
    if not flush and w + T > R + G:
        raise ValueError(f"append without flush: {w} + {T} tokens > R+G={R + G} window slots")
    f = flush_count(w, T, R, G) if flush else 0
    kind = {"kivi": KIVI, "tada": TADA, "int8": INT8}[codec.kind]
    V = codec.role == "v"
    assert all(t.is_contiguous() for t in st.values()), f"{codec}: storage must be contiguous"
    codes = st["codes"]
    if kind == KIVI and not V:
        c_h, c_p, c_b = codes.stride(0), 0, codes.stride(1)             # (Hkv, D, S·b/8)
    else:
        c_h, c_p, c_b = codes.stride(0), codes.stride(1), codes.stride(2)
    sc = st["scale"]
    zp = st.get("zero", sc)
    mu, mus = st.get("mu", codes), st.get("mu_scale", codes)
    if f:
        if n_tail + f > (sc.shape[1] * G if kind == KIVI and not V else sc.shape[1]):
            raise ValueError(f"tail storage too small for {n_tail + f} tokens")
    U = _unit(codec)
    u_first = n_tail // U
    nw = min(f, w)
    u_end = (n_tail + f - 1) // U + 1 if f else u_first
    u_w = (n_tail + nw - 1) // U + 1 if nw else u_first
    bits = 8 if kind == INT8 else codec.bits
    ng = D // codec.g if kind == KIVI and V else 1
    if kind == KIVI and V and D % codec.g:
        raise ValueError(f"D={D} is not a multiple of the V group {codec.g}")
    block_d = max(64 if V else 16, triton.next_power_of_2(D))
    grid = (1 + u_end - u_w, 1 if kind == TADA else Hkv)
    opts = dict(enable_fp_fusion=False) if win.is_cuda else {}
    _fused_kernel[grid](win, win.stride(0), win.stride(1), x, sx_h, sx_t, a, b, s_a, KH,
                        codes, c_h, c_p, c_b, sc, zp, sc.stride(0), mu, mus,
                        w, T, f, n_tail, Hkv, u_first, u_w - u_first, D,
                        KIND=kind, V=V, BITS=bits, MU8=kind == TADA and codec.mu == "int8",
                        G=G, U=U, NG=ng, VG=getattr(codec, "g", 1), SRC=SRC,
                        XDT=_XDT[rows_dtype], HAS_BIAS=has_bias, ALL_HEADS=kind == TADA,
                        BLOCK_D=block_d, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, **opts)
    return f


def rope_compress_k(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, win: torch.Tensor,
                    w: int, codec, st: dict, n_tail: int, R: int, flush: bool = True) -> int:
    """kernels.fused_compress.rope_compress_k in one launch: x (Hkv, T, D) new K rows before
    RoPE (fp32/fp16/bf16, unit channel stride), cos/sin (T, D); returns tokens packed."""
    Hkv, T, D = x.shape
    if win.shape[0] != Hkv or win.shape[2] != D:
        raise ValueError(f"K rows {tuple(x.shape)} do not match the window {tuple(win.shape)}")
    if cos.shape != (T, D) or sin.shape != (T, D) or cos.stride() != sin.stride():
        raise ValueError(f"cos/sin {tuple(cos.shape)} / {tuple(sin.shape)} must both be ({T}, {D}) with equal strides")
    if D % 2 or x.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("rope_compress_k: even D and unit channel strides required")
    return _launch(0, x.dtype, T, x, x.stride(0), x.stride(1), cos, sin, cos.stride(0), 0, False,
                   win, w, codec, st, n_tail, R, flush)


def vproj_compress(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   win: torch.Tensor, w: int, codec, st: dict, n_tail: int, R: int,
                   flush: bool = True) -> int:
    """kernels.fused_compress.vproj_compress in one launch: x (T, hidden) hidden states,
    weight (Hkv·D, hidden) (nn.Linear layout), bias (Hkv·D,) or None; returns tokens packed.
    weight None: x is the V rows (Hkv, T, D) as given (SRC 2: a weight-quantized v_proj
    computed them), appended and packed like K rows without RoPE."""
    Hkv, _, D = win.shape
    if weight is None:
        if x.dim() != 3 or x.shape[0] != Hkv or x.shape[2] != D or x.stride(-1) != 1:
            raise ValueError(f"V rows {tuple(x.shape)} must be ({Hkv}, T, {D}) with unit channel stride")
        if bias is not None:
            raise ValueError("vproj_compress: a bias needs the weight (rows are taken as given)")
        return _launch(2, x.dtype, x.shape[1], x, x.stride(0), x.stride(1), x, x, 0, 0, False,
                       win, w, codec, st, n_tail, R, flush)
    T, KH = x.shape
    if weight.shape != (Hkv * D, KH) or weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} != ({Hkv * D}, {KH}) with unit stride, "
                         f"or x {tuple(x.shape)} not unit-stride")
    if bias is not None and bias.shape != (Hkv * D,):
        raise ValueError(f"bias {tuple(bias.shape)} != ({Hkv * D},)")
    return _launch(1, x.dtype, T, x, 0, x.stride(0), weight, weight if bias is None else bias,
                   weight.stride(0), KH, bias is not None, win, w, codec, st, n_tail, R, flush)


def bytes_per_step(codec, Hkv: int, D: int, R: int, T: int = 1, flush: bool = False,
                   hidden: int | None = None, act_bytes: int = 2, win_bytes: int = 2) -> dict:
    """Memory traffic of one call (bytes) by item: `src` = K rows + cos/sin (rope_compress_k)
    or x + Wv (vproj_compress, `hidden` given); `window` = window bytes read and written;
    `tail` = packed bytes written (codec.bytes_per_token, exact) when the call flushes G
    tokens (`flush`), which also reads the window's R+G−1 tokens and rewrites R of them."""
    G = codec.G
    if hidden is None:
        src = act_bytes * T * (Hkv * D + 2 * D)
    else:
        src = act_bytes * (T * hidden + Hkv * D * hidden)
    win = win_bytes * Hkv * D * T
    tail = 0.0
    if flush:
        win += win_bytes * Hkv * D * ((R + G - 1) + R)
        tail = G * sum(codec.bytes_per_token(Hkv, D).values())
    return {"src": float(src), "window": float(win), "tail": tail}
