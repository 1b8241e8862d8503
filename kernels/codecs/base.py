"""The codec contract, and the two simplest codecs: uncompressed (fp16/bf16) and int8.

A codec is a compressed format for one of K or V of one layer. It declares its storage as
`Slot`s (the caller allocates them once for S tokens and owns them), packs whole blocks of
G tokens into them, and provides the read path used by `decode_attention`:

    scores(st, qg, s0, s1) -> (Hkv, R, n)   qg · k̂ᵀ for tail tokens [s0, s1)   (K role)
    mix(st, p, s0, s1)     -> (Hkv, R, D)   p · V̂ for tail tokens [s0, s1)      (V role)
    dequant(st, s0, s1)        -> (Hkv, n, D)   explicit reconstruction (tests, context shift)

R = query rows of a GQA group (G_q * T), n = s1 - s0; s0, s1 multiples of G (s1 may be the
tail end, also a multiple of G). The read path works from the packed codes block by block
with scales folded into q or p; `self.ws` holds the reusable unpack buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import nibble
from ..quant import Workspace, quantize_sym_int8, sym_int8_params

COMPONENTS = ("rows", "codes", "scales_zeros", "means", "lowrank", "outliers", "window")


@dataclass(frozen=True)
class Slot:
    """One preallocated storage tensor of a codec (for S tokens of one layer)."""
    name: str
    component: str          # one of COMPONENTS (accounting)
    shape: tuple
    dtype: torch.dtype
    axis: int               # token axis
    unit: int               # tokens per index along `axis` (1, or G for per-block data)

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


class Codec:
    """Base class. Subclasses set `method`, declare what they are — `kind` and `bits`, which
    the kernel table (kernels/table.py) reads — and implement slots/pack/dequant/scores/mix."""
    method = "?"
    kind = "?"                  # fp | int8 | kivi | tada | gear | cb
    bits = 0                    # code width (fp: the dtype's)
    # the codec's format assumes Hadamard-rotated rows (codebook.py): the arena then
    # rotates this role of the layer whatever the configured rotation says
    needs_rotation = False

    def __init__(self, role: str, G: int):
        assert role in ("k", "v"), role
        self.role, self.G = role, G
        self.ws = Workspace()

    def slots(self, Hkv: int, D: int, S: int) -> list[Slot]:
        raise NotImplementedError

    def alloc(self, Hkv: int, D: int, S: int, device="cpu") -> dict[str, torch.Tensor]:
        return {s.name: torch.zeros(s.shape, dtype=s.dtype, device=device)
                for s in self.slots(Hkv, D, S)}

    def bytes_per_token(self, Hkv: int, D: int) -> dict[str, float]:
        """Exact bytes one token costs in this codec's tail, by component (every slot is
        linear in the token count, so one block of G tokens / G is exact)."""
        out: dict[str, float] = {}
        S = 128 * self.G                  # a whole number of the nibble layouts' padding units
        for s in self.slots(Hkv, D, S):
            out[s.component] = out.get(s.component, 0.0) + s.nbytes / S
        return out

    # -- codes in the int4-GEMM nibble layout (nibble.py): token-major for K, channel-major for V
    def _nib_slot(self, Hkv: int, D: int, S: int, bits: int) -> Slot:
        assert self.G % 32 == 0, f"{self.method}: the group must be a multiple of 32, got {self.G}"
        self.D = D                        # head dim (channel-major storage pads it to 64)
        if self.role == "k":
            return Slot("codes", "codes", nibble.tok_shape(bits, Hkv, D, S), torch.uint8, 2, 1)
        return Slot("codes", "codes", nibble.chan_shape(bits, Hkv, D, S), torch.uint8, 3, 1)

    def _nib_write(self, st, codes, s0, bits):
        w = nibble.tok_write if self.role == "k" else nibble.chan_write
        w(st["codes"], codes, s0, bits)

    def _nib_codes(self, st, s0, s1, bits, D):
        """Integer codes (Hkv, n, D) float32 (dequantization, tests)."""
        if self.role == "k":
            return nibble.tok_codes(st["codes"], s0, s1, bits)
        return nibble.chan_codes(st["codes"], s0, s1, bits, D)

    def pack(self, st: dict, x: torch.Tensor, s0: int) -> torch.Tensor:
        """Compress x: (Hkv, n, D) float32, n % G == 0, into tokens [s0, s0+n).
        Returns the reconstruction (Hkv, n, D) float32 (what dequant would give)."""
        raise NotImplementedError

    def store(self, st: dict, x: torch.Tensor, s0: int) -> None:
        """pack() without computing the reconstruction (the arena's flushes): the same
        storage, bit for bit. Codecs whose reconstruction costs a pass override it."""
        self.pack(st, x, s0)

    def dequant(self, st: dict, s0: int, s1: int) -> torch.Tensor:
        raise NotImplementedError

    def scores(self, st, qg, s0, s1) -> torch.Tensor:
        raise NotImplementedError

    def mix(self, st, p, s0, s1) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}({self.method}, role={self.role}, G={self.G})"


class FpCodec(Codec):
    """Uncompressed tail (fp16, bf16 or fp32): the lossless codec, used in per-layer mixes."""
    kind = "fp"

    def __init__(self, role: str, G: int, dtype: torch.dtype = torch.float16):
        super().__init__(role, G)
        self.dtype = dtype
        self.method = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
        self.bits = dtype.itemsize * 8

    def slots(self, Hkv, D, S):
        return [Slot("x", "rows", (Hkv, S, D), self.dtype, 1, 1)]

    def pack(self, st, x, s0):
        st["x"][:, s0:s0 + x.shape[1]] = x
        return st["x"][:, s0:s0 + x.shape[1]].float()

    def dequant(self, st, s0, s1):
        return st["x"][:, s0:s1].float()

    def _load(self, st, s0, s1):
        x = st["x"][:, s0:s1]                                         # (Hkv, n, D)
        buf = self.ws.get("x", tuple(x.shape), x.device)
        return buf.copy_(x)

    def scores(self, st, qg, s0, s1):
        return torch.bmm(qg, self._load(st, s0, s1).transpose(1, 2))   # (Hkv, R, n)

    def mix(self, st, p, s0, s1):
        return torch.bmm(p, self._load(st, s0, s1))                    # (Hkv, R, D)


class Int8Codec(Codec):
    """Per-token-per-head symmetric int8 with an fp16 scale. Codes are stored offset by 128
    (u = c + 128 in [1, 255]) as two nibble planes (nibble.py):
        q·k̂_t = s_t (q·u_t − 128 Σq),   p·V̂ = (p ⊙ s)·U − 128 Σ_t p_t s_t."""
    method = "int8"
    kind, bits = "int8", 8

    def slots(self, Hkv, D, S):
        return [self._nib_slot(Hkv, D, S, 8),
                Slot("scale", "scales_zeros", (Hkv, S), torch.float16, 1, 1)]

    def pack(self, st, x, s0):
        n = x.shape[1]
        scale = sym_int8_params(x, -1)                                  # (Hkv, n, 1)
        self._nib_write(st, quantize_sym_int8(x, scale), s0, 8)
        st["scale"][:, s0:s0 + n] = scale[..., 0]
        return self.dequant(st, s0, s0 + n)

    def dequant(self, st, s0, s1):
        c = self._nib_codes(st, s0, s1, 8, self.D).sub_(128)
        return c * st["scale"][:, s0:s1, None].float()

    def scores(self, st, qg, s0, s1):
        sc = nibble.tok_dot(qg, st["codes"], s0, s1, 8, self.ws)      # (Hkv, R, n)
        sc.sub_(qg.sum(-1, keepdim=True), alpha=128)
        return sc.mul_(st["scale"][:, None, s0:s1].float())          # (fp16 operands in fp32
                                                                        # ops take a slow path)

    def mix(self, st, p, s0, s1):
        x = p * st["scale"][:, None, s0:s1].float()                     # (Hkv, R, n)
        o = nibble.chan_mix(x, st["codes"], s0, s1, 8, self.D, self.ws)  # (Hkv, R, D)
        return o.sub_(x.sum(-1, keepdim=True), alpha=128)
