"""KIVI, int8 and TaDA flushes on the native CPU kernel (decode_attention.c,
`kvrun_kivi_pack_k/v`, `kvrun_int8_pack`, `kvrun_tada_pack`): the same storage as the codecs' torch pack, bit
for bit (tests/test_native_kernels.py), in one C call per K or V instead of ~25 eager torch
ops (a 32-token KIVI-4 flush of SmolLM2 K: ~1 ms → ~0.08 ms; every layer flushes once per
G decode steps)."""
from __future__ import annotations

import ctypes

import torch

from ..codec_base import Int8Codec
from ..codec_kivi import KiviCodec
from ..codec_tada import TadaCodec
from . import load

_i64 = ctypes.c_int64


def supports(codec) -> bool:
    """Plain KIVI, int8 and TaDA (GEAR subclasses KIVI but adds terms the C pack does not
    write)."""
    return type(codec) in (KiviCodec, Int8Codec, TadaCodec) and load() is not None


def store(codec, st: dict, x: torch.Tensor, s0: int) -> bool:
    """codec.store(st, x, s0) in C; False when not covered (the caller packs with torch)."""
    lib = load()
    Hkv, n, D = x.shape
    if lib is None or x.device.type != "cpu" or D > 256:
        return False
    x = x.float().contiguous()
    codes, scale = st["codes"], st["scale"]
    if type(codec) is Int8Codec:
        cs = (_i64 * 4)(*codes.stride()[:4])
        return lib.kvrun_int8_pack(
            ctypes.c_void_p(x.data_ptr()), Hkv, n, D, _i64(s0), int(codec.role == "v"),
            ctypes.c_void_p(codes.data_ptr()), cs, ctypes.c_void_p(scale.data_ptr()),
            _i64(scale.stride(0)), _i64(scale.stride(1))) == 0
    zero = st["zero"]
    if type(codec) is TadaCodec:
        cs = (_i64 * 4)(*codes.stride()[:4])
        mu = st["mu"]
        ms = st["mu_scale"].data_ptr() if codec.mu == "int8" else None
        return lib.kvrun_tada_pack(
            ctypes.c_void_p(x.data_ptr()), Hkv, n, D, _i64(s0), codec.G, codec.bits,
            int(codec.role == "v"), ctypes.c_void_p(codes.data_ptr()), cs,
            ctypes.c_void_p(scale.data_ptr()), ctypes.c_void_p(zero.data_ptr()),
            _i64(scale.stride(0)), _i64(scale.stride(1)), ctypes.c_void_p(mu.data_ptr()),
            _i64(mu.stride(0)), ctypes.c_void_p(ms), int(codec.mu == "int8")) == 0
    if codec.role == "k":
        rc = lib.kvrun_kivi_pack_k(
            ctypes.c_void_p(x.data_ptr()), Hkv, n, D, _i64(s0), codec.G, codec.bits,
            ctypes.c_void_p(codes.data_ptr()), _i64(codes.stride(0)), _i64(codes.stride(1)),
            ctypes.c_void_p(scale.data_ptr()), ctypes.c_void_p(zero.data_ptr()),
            _i64(scale.stride(0)), _i64(scale.stride(1)))
    else:
        cs = (_i64 * 4)(*codes.stride()[:4])
        rc = lib.kvrun_kivi_pack_v(
            ctypes.c_void_p(x.data_ptr()), Hkv, n, D, _i64(s0), codec.g, codec.bits,
            ctypes.c_void_p(codes.data_ptr()), cs,
            ctypes.c_void_p(scale.data_ptr()), ctypes.c_void_p(zero.data_ptr()),
            _i64(scale.stride(0)), _i64(scale.stride(1)))
    return rc == 0
