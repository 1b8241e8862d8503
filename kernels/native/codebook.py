"""The codebook codecs' native CPU kernels (codebook_attention.c, codebook_pack.c): attention over a
cb K tail and a cb V tail read in place (`kvrun_cb_attention`, the same arguments and
result as kernels.decode_attention, and the arena's fused window append as in
native/decode_attention.py `attend_append`), and the flush (`kvrun_cb_pack`, the same
bytes as CodebookCodec.store). A pair with another codec on either side is not covered
(None: the caller runs torch); kernels/table.py says so.
"""
from __future__ import annotations

import ctypes

import torch

from ..table import covers
from . import load
from . import decode_attention as attention
from .decode_attention import MAX_D, TILE, Kernel, _cached, args_struct

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


class CbDesc(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_int32), ("codes", _p), ("cs", _i64 * 3),
                ("scale", _p), ("ss", _i64 * 2), ("lv", ctypes.c_float * 16)]


def covered(k_codec, v_codec) -> bool:
    """Whether the kernel reads this (K, V) pair: both codebook codecs of a width the
    kernel table's `cb_attention` row lists, once the library built."""
    return (covers("cb_attention", "native", k_codec) and covers("cb_attention", "native", v_codec)
            and load() is not None)


def describe(codec, st: dict) -> CbDesc:
    codes, scale = st["codes"], st["scale"]
    D = codes.shape[2] if codec.role == "k" else codes.shape[2] * 32
    c = CbDesc()
    c.bits, c.codes, c.scale = codec.bits, codes.data_ptr(), scale.data_ptr()
    for i in range(3):
        c.cs[i] = codes.stride(i)
    c.ss[0], c.ss[1] = scale.stride(0), scale.stride(1)
    for i, x in enumerate(codec.levels(D)[0].tolist()):
        c.lv[i] = x
    return c


def _descriptors(q, k_tail, v_tail, n_tail):
    D = q.shape[3]
    if (q.shape[0] != 1 or q.device.type != "cpu" or D > MAX_D or D % 32 or n_tail % TILE
            or not covered(k_tail[0], v_tail[0])):
        return None
    return _cached(*k_tail, describe_fn=describe), _cached(*v_tail, describe_fn=describe)


KERNEL = Kernel(_descriptors, args_struct(CbDesc), "kvrun_cb_attention")


def decode_attention(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, **kw):
    """kernels.decode_attention for a codebook pair: native/decode_attention.py's driver
    over codebook_attention.c; None when not covered."""
    return attention.decode_attention(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new,
                                      kernel=KERNEL, **kw)


def attend_append(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, k_dst, v_dst,
                  rot_k=None, rot_v=None, **kw):
    """native/decode_attention.py `attend_append` (rotate + round + window append +
    attention in one call) for a codebook pair; None when not covered."""
    return attention.attend_append(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new,
                                   k_dst, v_dst, rot_k, rot_v, kernel=KERNEL, **kw)


def store(codec, st: dict, x: torch.Tensor, s0: int) -> bool:
    """codec.store(st, x, s0) in C, the same bytes; False when not covered."""
    lib = load()
    Hkv, n, D = x.shape
    if (lib is None or x.device.type != "cpu" or D > MAX_D or D % 32 or n % 32 or s0 % 32
            or not covers("pack", "native", codec)):
        return False
    x = x.float().contiguous()
    lv, bd = codec.levels(D)
    codes, scale = st["codes"], st["scale"]
    rc = lib.kvrun_cb_pack(ctypes.c_void_p(x.data_ptr()), Hkv, n, D, _i64(s0),
                           int(codec.role == "v"), codec.bits,
                           ctypes.c_void_p(lv.data_ptr()), ctypes.c_void_p(bd.data_ptr()),
                           ctypes.c_void_p(codes.data_ptr()), (_i64 * 3)(*codes.stride()[:3]),
                           ctypes.c_void_p(scale.data_ptr()), (_i64 * 2)(*scale.stride()))
    return rc == 0
