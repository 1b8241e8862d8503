"""Weight-only quantized linear layers (int8 per output channel, int4 group-wise) and the
int8 embedding, run through torch's weight-only kernels.

Decode on CPU is bound by reading weights; llama.cpp reads Q4_1/Q8_0 blocks where kvrun
read fp16/fp32. These modules keep the bytes that `kvrun convert --weights int8|int4`
stored and compute with:

- few rows (decode, ≤ QUANT_OP_MAX_ROWS): the fused weight-only ops
  `aten._weight_int8pack_mm` (int8, one scale per output channel) and
  `aten._weight_int4pack_mm_for_cpu` (int4, group-wise scale + zero). On CPU their fast
  (AVX-512/AVX2) paths exist for bf16 activations and bf16 scales only — fp32 and fp16
  inputs hit a scalar loop (docs/measurements.md, "Figures behind the code") — so the GEMV
  input is cast to bf16 and the output back to the compute dtype. On CUDA the matching
  `_weight_int8pack_mm` / `_weight_int4pack_mm` run (bf16 as well; untested here).
- many rows (prefill): dequantize the layer to the compute dtype and use one dense GEMM.
  At prefill's row counts this beats either fused op (docs/measurements.md, "Figures
  behind the code"), because the ops are tuned for GEMV.

Stored format (what the state dict holds; `convert/quantize.py` writes it):
  int8  X.qweight (N, K) int8,   X.scales (N,) fp32:        w = q · scale
  int4  X.qweight (N, K/2) uint8, X.scales (N, K/G) fp16, X.mins (N, K/G) fp16:
        w = code · scale + min, code ∈ [0, 15]. In each group of G columns, byte j holds
        column j in its low nibble and column j + G/2 in its high nibble: llama.cpp's
        Q4_0/Q4_1 block layout, so a G=32 Q4_1 block is copied byte for byte.
The ops' packed copies (ISA-specific tile layouts) are derived at load in `prepare()` and
never stored. The int4 op takes (scale, zero) with w = (code − 8)·scale + zero, so
zero = min + 8·scale is computed in fp32 and rounded once to bf16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows the fused op is used (decode, short chunks); above, dequantize +
# dense GEMM. Measured (1536×576, 1 thread): the op wins up to ~48 rows (int8) / ~96 (int4).
QUANT_OP_MAX_ROWS = 32
WEIGHT_FORMATS = ("float", "int8", "int4")
INT4_GROUPS = (32, 64, 128)


def int4_group(in_features: int, group: int) -> int:
    """The group a tensor with `in_features` columns actually uses: `group`, halved until it
    divides the row (576 columns with --group 128 → 64). 0 when not even 32 divides it."""
    while group >= 32 and in_features % group:
        group //= 2
    return group if group >= 32 else 0


# -- torch references: the stored layout ⇄ codes / float weights ----------------------------

def pack_int4(codes: torch.Tensor, group: int) -> torch.Tensor:
    """codes (N, K) ints in [0, 15] → (N, K/2) uint8 in the stored nibble order."""
    N, K = codes.shape
    c = codes.to(torch.uint8).view(N, K // group, 2, group // 2)       # (N, K/G, 2, G/2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(N, K // 2)


def unpack_int4(qweight: torch.Tensor, group: int, dtype=torch.uint8) -> torch.Tensor:
    """(N, K/2) uint8 → codes (N, K) in `dtype`."""
    N, K2 = qweight.shape
    v = qweight.view(N, 2 * K2 // group, group // 2)                    # (N, K/G, G/2)
    out = torch.empty(N, 2 * K2 // group, group, dtype=dtype, device=qweight.device)
    out[..., :group // 2] = v & 15          # assignment casts: no uint8 → dtype temporary
    out[..., group // 2:] = v >> 4
    return out.view(N, 2 * K2)


def dequantize_int4(qweight, scales, mins, dtype=torch.float32) -> torch.Tensor:
    """(N, K) weights; in fp32 this is bit-exact to gguf's Q4_0/Q4_1 dequantization."""
    N, n_groups = scales.shape
    group = 2 * qweight.shape[1] // n_groups
    w = unpack_int4(qweight, group, dtype).view(N, n_groups, group)   # (N, K/G, G)
    w.mul_(scales.to(dtype)[..., None]).add_(mins.to(dtype)[..., None])
    return w.view(N, n_groups * group)


def dequantize_int8(qweight, scales, dtype=torch.float32) -> torch.Tensor:
    return qweight.to(dtype).mul_(scales.to(dtype)[:, None])


# -- modules ----------------------------------------------------------------------------------

def _op_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16          # CPU: the only vectorized path; CUDA: what the ops accept


class Int8Linear(nn.Module):
    """y = x Wᵀ + b with W stored as int8 (N, K) and one fp32 scale per output channel."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._op_scales: torch.Tensor | None = None        # (N,) bf16, built by prepare()

    def prepare(self) -> None:
        """Build the op's inputs from the loaded buffers (call again after moving devices)."""
        self._op_scales = self.scales.to(_op_dtype(self.qweight.device))

    def uses_fused_op(self, rows: int) -> bool:
        return self._op_scales is not None and rows <= QUANT_OP_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.uses_fused_op(rows):
            x2 = x.reshape(rows, x.shape[-1]).to(self._op_scales.dtype)          # (M, K)
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self._op_scales)
            y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        return F.linear(x, dequantize_int8(self.qweight, self.scales, x.dtype), self.bias)


class Int4Linear(nn.Module):
    """y = x Wᵀ + b with W stored as 4-bit codes, group-wise fp16 scale and min (see top)."""

    def __init__(self, in_features: int, out_features: int, group: int, bias: bool = False):
        super().__init__()
        assert in_features % group == 0, f"{in_features} columns are not a multiple of {group}"
        self.in_features, self.out_features, self.group = in_features, out_features, group
        n_groups = in_features // group
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2,
                                                    dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, n_groups, dtype=torch.float16))
        self.register_buffer("mins", torch.empty(out_features, n_groups, dtype=torch.float16))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._packed: torch.Tensor | None = None       # the op's tile layout, built by prepare()
        self._scale_zero: torch.Tensor | None = None   # (K/G, N, 2) bf16

    def prepare(self) -> None:
        """Repack codes and (scale, zero) for the fused op of the buffers' device."""
        dev = self.qweight.device
        codes = unpack_int4(self.qweight, self.group, torch.int32)              # (N, K)
        s, m = self.scales.float(), self.mins.float()
        sz = torch.stack([s, m + 8 * s], -1).transpose(0, 1)                     # (K/G, N, 2)
        self._scale_zero = sz.to(_op_dtype(dev)).contiguous()
        if dev.type == "cpu" and self.out_features % 16 == 0:      # the CPU pack's tile
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        elif dev.type == "cuda" and self.out_features % 8 == 0:
            # CUDA takes (N, K/2) uint8 with the even column in the high nibble and an
            # inner-K tiling that must divide K/16.
            tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
            u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
            self._packed = torch.ops.aten._convert_weight_to_int4pack(u8, tiles)
        else:
            self._packed = None                # no fused op for this shape: always dequantize

    def _fused(self, x2: torch.Tensor) -> torch.Tensor:
        x2 = x2.to(self._scale_zero.dtype)
        if x2.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self._packed, self.group,
                                                               self._scale_zero)
        return torch.ops.aten._weight_int4pack_mm(x2, self._packed, self.group, self._scale_zero)

    def uses_fused_op(self, rows: int) -> bool:
        return self._packed is not None and rows <= QUANT_OP_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.uses_fused_op(rows):
            y = self._fused(x.reshape(rows, x.shape[-1]))                       # (M, N)
            y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        w = dequantize_int4(self.qweight, self.scales, self.mins, x.dtype)
        return F.linear(x, w, self.bias)


class Int8Embedding(nn.Module):
    """Token embedding stored as int8 rows with one fp32 scale per token (what llama.cpp's
    Q8_0 token_embd amounts to, with a per-row instead of per-32 scale). Per-row scales make
    the same buffers a valid `Int8Linear` weight, so a tied lm_head shares them."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.register_buffer("qweight", torch.empty(num_embeddings, dim, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(num_embeddings, dtype=torch.float32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) → float32 rows (B, T, C); the model casts to its compute dtype."""
        return self.qweight[ids].float().mul_(self.scales[ids].float()[..., None])


def make_linear(weights: str, group: int, in_features: int, out_features: int,
                bias: bool = False) -> nn.Module:
    """The linear layer for a model whose config says `weights` (float | int8 | int4)."""
    from .layers import Linear
    if weights == "int8":
        return Int8Linear(in_features, out_features, bias)
    if weights == "int4":
        return Int4Linear(in_features, out_features, int4_group(in_features, group), bias)
    return Linear(in_features, out_features, bias)


QUANT_MODULES = (Int8Linear, Int4Linear)
