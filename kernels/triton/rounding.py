"""torch's rounding in registers, shared by the Triton kernels that must store what torch
stores bit for bit (window_write.py's rows, ring_attention.py's ring codes and rows,
kivi_pack.py's codes)."""
import torch
import triton
import triton.language as tl

# the dtype codes `_rnd` takes (XDT), by the rows' torch dtype
XDT_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _rnd(v, XDT: tl.constexpr):
    """v rounded to the rows' dtype (0 fp32, 1 fp16, 2 bf16), back in fp32. bf16 by
    integer round-to-nearest-even on the bits (finite v): Triton's interpreter truncates
    fp32 → bf16 casts, and the explicit form rounds the same way on every backend."""
    if XDT == 1:
        v = v.to(tl.float16).to(tl.float32)
    elif XDT == 2:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        v = b.to(tl.float32, bitcast=True)
    return v


@triton.jit
def _rhe(v):
    """Round half to even (exact for |v| < 2^22), like torch.round."""
    return (v + 12582912.0) - 12582912.0
