"""write_k and write_v, Triton (kernels/dispatch.py): one launch per layer per call computes
the new K rows with RoPE (or the new V rows with the V projection, or takes V rows as given
when the model's v_proj is weight-quantized) and writes them into the residual window at
slots [w, w + T) — bit-identical to the torch oracle (kernels/window_write.py). The arena's
fused-write step calls them through kernels/dispatch.py (runtime/kv/arena.py `attend_new`):
the launch writes the new rows, `decode_attention` reads tail + window, and the arena's one
flush (`KVArena.flush` → `pack`, `kivi_pack` for KIVI) packs the blocks that leave after it.

Rounding is torch's: fp32 → fp16 round-to-nearest-even, bf16 by integer rounding of the bits,
no fused multiply-add (`enable_fp_fusion=False` on GPU). RoPE in fp16/bf16 rounds after each
operation like torch's CPU half arithmetic. Exception: write_v's projection is a tiled fp32
dot product whose summation order differs from torch's GEMM, so its rows match torch only
where the matmul is exact (tests: dyadic inputs, exact products).

`_write_kernel`, grid (Hkv, runs of BLOCK_T = 32 new tokens): each program computes its
run's rows in registers (`_new_rows`) and stores them. Blocks: BLOCK_D = next power of two
>= max(D, 16), BLOCK_K = 32 hidden channels per dot step (write_v), 4 warps.

Bytes per decode step (T = 1; fp16 window; Llama-3.1-70B: Hkv 8, D 128, hidden 8192), see
`bytes_per_step`: write_k reads the new row and its cos/sin (2 KiB + 0.5 KiB) and writes
2 KiB of window; write_v reads x (16 KiB) and Wv (16 MiB: the projection's weight dominates)
and writes 2 KiB. The flush that follows every G steps is `pack`'s traffic, not this op's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import XDT_CODES, _rnd

NUM_WARPS = 4
BLOCK_T = 32
BLOCK_K = 32


@triton.jit
def _new_rows(h, j, j_ok, d, X, sx_h, sx_t, A, B, s_a, KH, D,
              SRC: tl.constexpr, XDT: tl.constexpr, HAS_BIAS: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """Rows (N, len(d)) fp32 of new tokens j (N,) for KV head h at channels d, rounded to
    the rows' dtype (0 where j_ok or d < D is false): SRC 0 RoPE of X (Hkv, T, D) with
    A = cos, B = sin (T, D); SRC 1 X (T, KH) @ A[h·D + d]ᵀ (+ B[h·D + d]), A = Wv
    (Hkv·D, KH); SRC 2 the rows of X (Hkv, T, D) as given."""
    d_ok = d < D
    m = j_ok[:, None] & d_ok[None, :]
    if SRC == 0:
        # -- RoPE, rotate-half: y = x·cos + [−x_{d+D/2} | x_{d−D/2}]·sin ------------------
        half = D // 2
        lo = (d < half)[None, :]
        dp = tl.where(d < half, d + half, d - half)
        xa = tl.load(X + h * sx_h + j[:, None] * sx_t + d[None, :], mask=m, other=0.0)
        xb = tl.load(X + h * sx_h + j[:, None] * sx_t + dp[None, :], mask=m, other=0.0)
        xb = tl.where(lo, -xb.to(tl.float32), xb.to(tl.float32))
        c = _rnd(tl.load(A + j[:, None] * s_a + d[None, :], mask=m, other=0.0).to(tl.float32), XDT)
        s = _rnd(tl.load(B + j[:, None] * s_a + d[None, :], mask=m, other=0.0).to(tl.float32), XDT)
        y = _rnd(_rnd(xa.to(tl.float32) * c, XDT) + _rnd(xb * s, XDT), XDT)
    elif SRC == 2:
        y = tl.load(X + h * sx_h + j[:, None] * sx_t + d[None, :], mask=m,
                    other=0.0).to(tl.float32)                    # exact: already in XDT
    else:
        # -- V projection: fp32 accumulation over the hidden dim --------------------------
        acc = tl.zeros(m.shape, tl.float32)
        kk = tl.arange(0, BLOCK_K)
        for k0 in range(0, KH, BLOCK_K):
            k_ok = (k0 + kk) < KH
            xk = tl.load(X + j[:, None] * sx_t + (k0 + kk)[None, :],
                         mask=j_ok[:, None] & k_ok[None, :], other=0.0)
            wk = tl.load(A + (h * D + d)[:, None] * s_a + (k0 + kk)[None, :],
                         mask=d_ok[:, None] & k_ok[None, :], other=0.0).to(xk.dtype)
            if XDT == 0:
                acc += tl.dot(xk, tl.trans(wk), input_precision="ieee")
            else:
                acc += tl.dot(xk, tl.trans(wk))
        if HAS_BIAS:
            acc += _rnd(tl.load(B + h * D + d, mask=d_ok, other=0.0).to(tl.float32), XDT)[None, :]
        y = _rnd(acc, XDT)
    return tl.where(m, y, 0.0)


@triton.jit
def _write_kernel(WIN, sw_h, sw_t, X, sx_h, sx_t, A, B, s_a, KH, w, T, D,
                  SRC: tl.constexpr, XDT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (Hkv, cdiv(T, BLOCK_T)): KV head h's new tokens [p·BLOCK_T, (p+1)·BLOCK_T) into
    window slots w + j."""
    h = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    j_ok = j < T
    y = _new_rows(h, j, j_ok, d, X, sx_h, sx_t, A, B, s_a, KH, D, SRC, XDT, HAS_BIAS, BLOCK_K)
    if WIN.dtype.element_ty == tl.bfloat16:
        y = _rnd(y, 2)
    tl.store(WIN + h * sw_h + (w + j)[:, None] * sw_t + d[None, :], y.to(WIN.dtype.element_ty),
             mask=j_ok[:, None] & (d < D)[None, :])


def _launch(SRC, rows_dtype, T, x, sx_h, sx_t, a, b, s_a, KH, has_bias, win, w) -> None:
    Hkv, slots, D = win.shape
    if win.stride(-1) != 1:
        raise ValueError(f"window {tuple(win.shape)} must have unit channel stride")
    if w < 0 or w + T > slots:
        raise ValueError(f"window write: {w} + {T} tokens > {slots} window slots")
    opts = dict(enable_fp_fusion=False) if win.is_cuda else {}
    grid = (Hkv, triton.cdiv(T, BLOCK_T))
    _write_kernel[grid](win, win.stride(0), win.stride(1), x, sx_h, sx_t, a, b, s_a, KH, w, T, D,
                        SRC=SRC, XDT=XDT_CODES[rows_dtype], HAS_BIAS=has_bias,
                        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_T=BLOCK_T,
                        BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, **opts)


def write_k(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, win: torch.Tensor, w: int) -> None:
    """kernels.window_write.write_k in one launch: x (Hkv, T, D) new K rows before RoPE
    (fp32/fp16/bf16, unit channel stride), cos/sin (T, D)."""
    Hkv, T, D = x.shape
    if win.shape[0] != Hkv or win.shape[2] != D:
        raise ValueError(f"K rows {tuple(x.shape)} do not match the window {tuple(win.shape)}")
    if cos.shape != (T, D) or sin.shape != (T, D) or cos.stride() != sin.stride():
        raise ValueError(f"cos/sin {tuple(cos.shape)} / {tuple(sin.shape)} must both be ({T}, {D}) with equal strides")
    if D % 2 or x.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("write_k: even D and unit channel strides required")
    _launch(0, x.dtype, T, x, x.stride(0), x.stride(1), cos, sin, cos.stride(0), 0, False, win, w)


def write_v(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
            win: torch.Tensor, w: int) -> None:
    """kernels.window_write.write_v in one launch: x (T, hidden) hidden states, weight
    (Hkv·D, hidden) (nn.Linear layout), bias (Hkv·D,) or None. weight None: x is the V rows
    (Hkv, T, D) as given (SRC 2: a weight-quantized v_proj computed them)."""
    Hkv, _, D = win.shape
    if weight is None:
        if x.dim() != 3 or x.shape[0] != Hkv or x.shape[2] != D or x.stride(-1) != 1:
            raise ValueError(f"V rows {tuple(x.shape)} must be ({Hkv}, T, {D}) with unit channel stride")
        if bias is not None:
            raise ValueError("write_v: a bias needs the weight (rows are taken as given)")
        _launch(2, x.dtype, x.shape[1], x, x.stride(0), x.stride(1), x, x, 0, 0, False, win, w)
        return
    T, KH = x.shape
    if weight.shape != (Hkv * D, KH) or weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} != ({Hkv * D}, {KH}) with unit stride, "
                         f"or x {tuple(x.shape)} not unit-stride")
    if bias is not None and bias.shape != (Hkv * D,):
        raise ValueError(f"bias {tuple(bias.shape)} != ({Hkv * D},)")
    _launch(1, x.dtype, T, x, 0, x.stride(0), weight, weight if bias is None else bias,
            weight.stride(0), KH, bias is not None, win, w)


def bytes_per_step(Hkv: int, D: int, T: int = 1, hidden: int | None = None,
                   act_bytes: int = 2, win_bytes: int = 2) -> dict:
    """Memory traffic of one call (bytes) by item: `src` = K rows + cos/sin (write_k) or
    x + Wv (write_v, `hidden` given); `window` = the window bytes written."""
    if hidden is None:
        src = act_bytes * T * (Hkv * D + 2 * D)
    else:
        src = act_bytes * (T * hidden + Hkv * D * hidden)
    return {"src": float(src), "window": float(win_bytes * Hkv * D * T)}
