"""Quantization primitives shared by every KV codec: round-to-nearest asymmetric and
symmetric quantizers, and 2/4/8-bit packing into 32-bit words.

Packing layout (why it looks like this): codes are packed along the *token* axis, P = 32/b
tokens of the same channel per int32 word, within each block of G tokens (`pack_codes`).
Unpacking a whole read block is then two wide tensor ops whose contiguous inner dimension
is G/P*D elements: a broadcast AND with the P plane masks, writing the P token planes in
token order, and an in-place int32 → float32 conversion. Each token's row comes from one
plane, so the plane's power-of-two weight 2^(b*i) (and the top plane's sign offset) are a
per-token scale α_t and offset β_t that the codecs fold into their scales and zeros for
free — exact, no cancellation. (The layout was chosen when torch's uint8 → float
conversion was not vectorized on CPU; on torch 2.13 it is, and the int32 mask + convert is
the slower of the two: docs/measurements.md, "Figures behind the code". The codecs' codes now
use byte layouts, chanpack.py and nibble.py; these words remain for TaDA's int8 means.)

Scales and zero points are stored in fp16 (KIVI, GEAR); codes are computed against the
*rounded* fp16 parameters so the stored triple reconstructs within the RTN bound.
"""
from __future__ import annotations

import torch

def qmax(bits: int) -> int:
    return (1 << bits) - 1


def asym_params(x: torch.Tensor, dim, bits: int):
    """Min-max (scale, zero) in fp16 over `dim` (int or tuple), keepdim. x float32."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    zero = lo.to(torch.float16)
    # scale from the rounded zero so [zero, zero + qmax*scale] covers hi
    scale = ((hi - zero.float()) / qmax(bits)).clamp_min(1e-6).to(torch.float16)
    # fp16 rounding may have shrunk the scale below what covers hi: nudge it up one ulp
    short = zero.float() + scale.float() * qmax(bits) < hi
    scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, 65504.0)), scale)
    return scale, zero


def quantize_asym(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes round((x - zero) / scale) clamped to [0, 2^bits - 1]."""
    c = torch.round((x - zero.float()) / scale.float())
    return c.clamp_(0, qmax(bits)).to(torch.uint8)


def dequantize_asym(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float() + zero.float()


def sym_int8_params(x: torch.Tensor, dim) -> torch.Tensor:
    """fp16 symmetric scale amax/127 over `dim`, keepdim, at least 2^-24 (the smallest
    positive fp16: a floor that rounds to 0 in fp16 made all-zero rows NaN codes)."""
    return (x.abs().amax(dim=dim, keepdim=True) / 127.0).clamp_min(2.0 ** -24).to(torch.float16)


def quantize_sym_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes in [-127, 127] stored offset by +128 as uint8 (so they unpack like 8-bit codes)."""
    c = torch.round(x / scale.float()).clamp_(-127, 127)
    return (c + 128).to(torch.uint8)


# -- bit packing ------------------------------------------------------------------------

def word_planes(bits: int) -> int:
    """Codes per int32 word of the word-packed layout (`pack_codes`): its token planes."""
    return 32 // bits


def pack_codes(codes: torch.Tensor, bits: int, G: int) -> torch.Tensor:
    """codes: (..., n, D) uint8 < 2^bits, n a multiple of G → (..., n*bits/32, D) int32.

    Within each block of G tokens, word row j holds tokens j + i*G/P of plane i = 0..P-1
    (P = 32/bits codes per word) at bits [bits*i, bits*(i+1)); the top plane is stored as
    the two's-complement field c - 2^(bits-1) so that masking alone yields a signed value.
    """
    *lead, n, D = codes.shape
    P = word_planes(bits)
    J = G // P
    assert n % G == 0 and G % P == 0, (n, G, P)
    c = codes.to(torch.int64).reshape(*lead, n // G, P, J, D)             # (..., nb, P, J, D)
    c[..., P - 1, :, :] -= 1 << (bits - 1)
    c[..., P - 1, :, :] %= 1 << bits
    shifts = (torch.arange(P, dtype=torch.int64) * bits).view(P, 1, 1)
    words = (c << shifts).sum(dim=-3)                                     # (..., nb, J, D) < 2^32
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.reshape(*lead, n // P, D)


_MASKS: dict[int, torch.Tensor] = {}
_FOLD: dict[tuple, tuple] = {}


def unpack_codes_into(words: torch.Tensor, bits: int, G: int, out: torch.Tensor,
                      scale: torch.Tensor | None = None, view: tuple | None = None) -> torch.Tensor:
    """Unpack (..., n*bits/32, D) int32 words into float32 `out` (..., n, D) holding
    v = (c - β_t) / α_t — the codes up to a per-token power-of-two scale and offset
    (see `plane_fold`). Two wide ops (mask, int→float in place): no shifts, which torch
    runs slowly on CPU, and no per-plane Python loop."""
    P = word_planes(bits)
    J = G // P
    *lead, rows, D = words.shape
    m = _MASKS.get(bits)
    if m is None:
        m = torch.tensor([((1 << bits) - 1) << (bits * i) for i in range(P)], dtype=torch.int64)
        m = _MASKS[bits] = torch.where(m >= 2 ** 31, m - 2 ** 32, m).to(torch.int32).view(P, 1, 1)
    w = words.reshape(*lead, rows // J, 1, J, D)                          # (..., nb, 1, J, D)
    o = out.view(torch.int32).view(*lead, rows // J, P, J, D)            # (..., nb, P, J, D)
    torch.bitwise_and(w, m.to(words.device), out=o)
    out.copy_(out.view(torch.int32))                                      # exact: ≤ bits significant bits
    if scale is not None:                       # (torch.mul(int, float, out=) would allocate a copy)
        out.view(view).mul_(scale)
    return out


def plane_fold(n: int, bits: int, G: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(α, β): (n,) float32 with code c_t = α_t · v_t + β_t for unpacked values v."""
    key = (n, bits, G, str(device))
    if key not in _FOLD:
        P = word_planes(bits)
        J = G // P
        plane = (torch.arange(n) % G) // J                                # (n,)
        alpha = torch.pow(2.0, -(bits * plane).double()).float()
        beta = torch.where(plane == P - 1, float(1 << (bits - 1)), 0.0).float()
        _FOLD[key] = (alpha.to(device), beta.to(device))
    return _FOLD[key]


def unpack_codes(words: torch.Tensor, bits: int, G: int) -> torch.Tensor:
    """Integer codes as float32 (..., n, D) — for dequantization and tests."""
    *lead, rows, D = words.shape
    n = rows * word_planes(bits)
    out = torch.empty(*lead, n, D, dtype=torch.float32, device=words.device)
    unpack_codes_into(words, bits, G, out)
    alpha, beta = plane_fold(n, bits, G, words.device)
    return out.mul_(alpha[:, None]).add_(beta[:, None])


class Workspace:
    """Reusable float32 scratch buffers keyed by name, grown on demand.

    Large temporaries freshly allocated every decode step cost page faults on CPU; the
    read path unpacks each block into the same buffer instead.
    """

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple, device=None) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        b = self._bufs.get(name)
        if b is None or b.numel() < n or (device is not None and b.device != torch.device(device)):
            # grow geometrically: a buffer sized by the context (logits) grows by one token per
            # step, and a fresh large allocation page-faults (~50 µs) every time
            grow = b.numel() * 3 // 2 if b is not None and b.device == torch.device(device or "cpu") else 0
            b = self._bufs[name] = torch.empty(max(n, grow), dtype=torch.float32, device=device)
        return b[:n].view(shape)

    def get_u8(self, name: str, shape: tuple, device=None) -> torch.Tensor:
        """A uint8 scratch buffer (bit manipulation of packed codes)."""
        return self.get_as(name, shape, torch.uint8, device)

    def get_as(self, name: str, shape: tuple, dtype: torch.dtype, device=None) -> torch.Tensor:
        """A scratch buffer of another dtype (uint8 codes, bf16 GEMM results)."""
        size = torch.empty((), dtype=dtype).element_size()
        b = self.get(name, (-(-_numel(shape) * size // 4),), device)
        return b.view(dtype)[:_numel(shape)].view(shape)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
