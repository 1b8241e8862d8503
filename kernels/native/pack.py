"""KIVI, int8, TaDA and codebook flushes on the native CPU kernel (pack.c,
`kvrun_kivi_pack_k/v`, `kvrun_int8_pack`, `kvrun_tada_pack`; codebook_pack.c,
`kvrun_cb_pack`): the same storage as the codecs' torch pack, bit
for bit (tests/kernels/test_native_pack.py), in one C call per K or V instead of ~25 eager torch
ops (every layer flushes once per G decode steps; a flush's time on each:
docs/measurements.md, "Figures behind the code")."""
from __future__ import annotations

import ctypes

import torch

from ..table import covers
from . import load
from .decode_attention import MAX_D

_i64 = ctypes.c_int64


def supports(codec) -> bool:
    """The kinds the kernel table's native `pack` row lists (KIVI, int8, TaDA, cb; not GEAR,
    whose outliers and low-rank terms the C pack does not write), once the library built."""
    return covers("pack", "native", codec) and load() is not None


def covers_layer(codec, D: int, G: int) -> bool:
    """Whether `store` takes every flush of a layer of this codec, head dim D and blocks of G
    tokens (whole blocks at multiples of G; a codebook role packs whole 32-token groups)."""
    return supports(codec) and D <= MAX_D and (codec.kind != "cb" or (D % 32 == 0 and G % 32 == 0))


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def store(codec, st: dict, x: torch.Tensor, s0: int) -> bool:
    """codec.store(st, x, s0) in C; False when not covered (the caller packs with torch):
    a codec `supports` does not take (GEAR: its outliers and low-rank terms), a head dim
    past MAX_D, tensors off the CPU."""
    if codec.kind == "cb":
        return _cb_store(codec, st, x, s0)
    lib = load()
    Hkv, n, D = x.shape
    if not supports(codec) or x.device.type != "cpu" or D > MAX_D:
        return False
    x = x.float().contiguous()
    codes, scale, zero = st["codes"], st["scale"], st.get("zero")
    cs = (_i64 * 4)(*codes.stride()[:4])                    # tok / chan layouts: 5-d
    ss0, ss1 = _i64(scale.stride(0)), _i64(scale.stride(1))
    v = int(codec.role == "v")
    if codec.kind == "int8":
        rc = lib.kvrun_int8_pack(_ptr(x), Hkv, n, D, _i64(s0), v, _ptr(codes), cs, _ptr(scale),
                                 ss0, ss1)
    elif codec.kind == "tada":
        mu8 = codec.mu == "int8"
        rc = lib.kvrun_tada_pack(_ptr(x), Hkv, n, D, _i64(s0), codec.G, codec.bits, v,
                                 _ptr(codes), cs, _ptr(scale), _ptr(zero), ss0, ss1,
                                 _ptr(st["mu"]), _i64(st["mu"].stride(0)),
                                 _ptr(st["mu_scale"] if mu8 else None), int(mu8))
    elif v:
        rc = lib.kvrun_kivi_pack_v(_ptr(x), Hkv, n, D, _i64(s0), codec.g, codec.bits,
                                   _ptr(codes), cs, _ptr(scale), _ptr(zero), ss0, ss1)
    else:                                                   # chanpack (Hkv, D, M): 3-d
        hi = st.get("hi")                                   # 3 bits: the third bits' planes
        hs = hi.stride()[:2] if hi is not None else (0, 0)
        rc = lib.kvrun_kivi_pack_k(_ptr(x), Hkv, n, D, _i64(s0), codec.G, codec.bits,
                                   _ptr(codes), _i64(codes.stride(0)), _i64(codes.stride(1)),
                                   _ptr(hi), _i64(hs[0]), _i64(hs[1]),
                                   _ptr(scale), _ptr(zero), ss0, ss1)
    return rc == 0


def _cb_store(codec, st: dict, x: torch.Tensor, s0: int) -> bool:
    """A codebook codec's flush (codebook_pack.c): whole 32-token groups of a head dim that
    is a multiple of 32."""
    lib = load()
    Hkv, n, D = x.shape
    if (lib is None or x.device.type != "cpu" or D > MAX_D or D % 32 or n % 32 or s0 % 32
            or not covers("pack", "native", codec)):
        return False
    x = x.float().contiguous()
    lv, bd = codec.levels(D)
    codes, scale = st["codes"], st["scale"]
    rc = lib.kvrun_cb_pack(_ptr(x), Hkv, n, D, _i64(s0), int(codec.role == "v"), codec.bits,
                           _ptr(lv), _ptr(bd), _ptr(codes), (_i64 * 3)(*codes.stride()[:3]),
                           _ptr(scale), (_i64 * 2)(*scale.stride()))
    return rc == 0
