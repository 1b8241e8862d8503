"""The codebook codecs' native CPU kernels (codebook_attention.c, codebook_pack.c): attention over a
cb K tail and a cb V tail read in place (`kvrun_cb_attention`, the same arguments and
result as kernels.decode_attention, and the arena's fused window append as in
native/decode_attention.py `attend_append`), and the flush (`kvrun_cb_pack`, the same
bytes as CodebookCodec.store). A pair with another codec on either side is not covered
(None: the caller runs torch); kernels/table.py says so.
"""
from __future__ import annotations

import ctypes
import weakref

import torch

from ..decode_attention import DEFAULT_Q_CHUNK, SCORE_LIMIT
from ..table import covers
from . import load
from .decode_attention import MAX_D, TILE, _splits_max

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_FP = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


class CbDesc(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_int32), ("codes", _p), ("cs", _i64 * 3),
                ("scale", _p), ("ss", _i64 * 2), ("lv", ctypes.c_float * 16)]


class CbArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("Hkv", "R", "D", "Tq", "t0", "n_tail", "W", "Tn",
                                              "wdtype", "ndtype", "qdtype", "mass_lo", "Gq", "nthreads")] + [
        ("qin", _p), ("qs", _i64 * 2), ("q", _p), ("kw", _p), ("vw", _p), ("kws", _i64 * 2), ("vws", _i64 * 2),
        ("kn", _p), ("vn", _p), ("kns", _i64 * 2), ("vns", _i64 * 2),
        ("out", _p), ("sc", _p), ("part", _p), ("mass", _p), ("mass_stride", _i64),
        ("kc", ctypes.POINTER(CbDesc)), ("vc", ctypes.POINTER(CbDesc)),
        ("rk", _p), ("rv", _p), ("kdst", _p), ("vdst", _p), ("kds", _i64 * 2), ("vds", _i64 * 2)]


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


_DESC: dict = {}          # (id(codec), id(codes)) -> (weakref to codes, descriptor)


def _cached(codec, st: dict) -> CbDesc:
    """describe() once per storage (native/decode_attention.py `_cached`, same reasons)."""
    t = st["codes"]
    key = (id(codec), id(t))
    hit = _DESC.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    d = describe(codec, st)
    _DESC[key] = (weakref.ref(t, lambda _, k=key: _DESC.pop(k, None)), d)
    return d


def _descriptors(q, k_tail, v_tail, n_tail):
    D = q.shape[3]
    if (q.shape[0] != 1 or q.device.type != "cpu" or D > MAX_D or D % 32 or n_tail % TILE
            or not covered(k_tail[0], v_tail[0])):
        return None
    return _cached(*k_tail), _cached(*v_tail)


def decode_attention(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, block=None,
                     q_chunk: int = DEFAULT_Q_CHUNK, mass=None, mass_from: int = 0):
    """kernels.decode_attention for a codebook pair; None when not covered."""
    _, H, T, D = q.shape
    desc = _descriptors(q, k_tail, v_tail, n_tail)
    if desc is None:
        return None
    N = n_tail + k_win.shape[2] + T
    if mass is not None:
        assert mass.shape == (H, N) and mass.dtype == torch.float32 and mass.is_contiguous(), \
            f"mass {tuple(mass.shape)} {mass.dtype} != ({H}, {N}) float32"
    q_chunk = max(1, min(q_chunk, SCORE_LIMIT // (H * N)))
    if T <= q_chunk:
        return _attend(q, *desc, n_tail, k_win, v_win, k_new, v_new, 0, mass, mass_from)
    out = torch.empty_like(q)
    for t0 in range(0, T, q_chunk):
        t1 = min(T, t0 + q_chunk)
        out[:, :, t0:t1] = _attend(q[:, :, t0:t1], *desc, n_tail, k_win, v_win, k_new[:, :, :t1],
                                   v_new[:, :, :t1], t0, mass, mass_from)
    return out


def attend_append(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, k_dst, v_dst,
                  rot_k=None, rot_v=None, mass=None, mass_from=0):
    """native/decode_attention.py `attend_append` (rotate + round + window append +
    attention in one call) for a codebook pair; None when not covered."""
    _, H, T, D = q.shape
    N = n_tail + k_win.shape[2] + T
    desc = _descriptors(q, k_tail, v_tail, n_tail)
    if (desc is None or T > min(DEFAULT_Q_CHUNK, SCORE_LIMIT // (H * N))
            or k_dst.stride(2) != 1 or v_dst.stride(2) != 1):
        return None
    for r in (rot_k, rot_v):
        assert r is None or (r.dtype == torch.float32 and r.is_contiguous()), "rotation: (D, D) float32"
    return _attend(q, *desc, n_tail, k_win, v_win, k_new, v_new, 0, mass, mass_from,
                   fuse=(k_dst, v_dst, rot_k, rot_v))


_BUF: dict = {}


def _scratch(name: str, n: int) -> int:
    b = _BUF.get(name)
    if b is None or b.numel() < n:
        b = _BUF[name] = torch.empty(max(n, b.numel() * 3 // 2 if b is not None else 0))
    return b.data_ptr()


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(3) == 1 else x.contiguous()


def _attend(q, kd, vd, n_tail, k_win, v_win, k_new, v_new, t0, mass, mass_from, fuse=None):
    _, H, Tq, D = q.shape
    Hkv, W, Tn = k_new.shape[1], k_win.shape[2], k_new.shape[2]
    Gq = H // Hkv
    R = Gq * Tq
    N = n_tail + W + Tn
    nth = torch.get_num_threads()
    q, kw, vw, kn, vn = _rows(q), _rows(k_win), _rows(v_win), _rows(k_new), _rows(v_new)
    assert kw.dtype == vw.dtype and kn.dtype == vn.dtype, (kw.dtype, kn.dtype)
    out = torch.empty(1, H, Tq, D)                                       # (Hkv, R, D) rows
    a = CbArgs(Hkv, R, D, Tq, t0, n_tail, W, Tn, _FP[kw.dtype], _FP[kn.dtype], _FP[q.dtype],
               mass_from, Gq, nth, q.data_ptr(), (q.stride(1), q.stride(2)),
               _scratch("q", H * Tq * D), kw.data_ptr(), vw.data_ptr(),
               (kw.stride(1), kw.stride(2)), (vw.stride(1), vw.stride(2)), kn.data_ptr(),
               vn.data_ptr(), (kn.stride(1), kn.stride(2)), (vn.stride(1), vn.stride(2)),
               out.data_ptr(), _scratch("sc", Hkv * R * N), _scratch("part", Hkv * _splits_max(load()) * R * D),
               mass.data_ptr() if mass is not None else None,
               mass.stride(0) if mass is not None else 0, ctypes.pointer(kd), ctypes.pointer(vd))
    if fuse is not None:
        k_dst, v_dst, rot_k, rot_v = fuse
        a.rk = rot_k.data_ptr() if rot_k is not None else None
        a.rv = rot_v.data_ptr() if rot_v is not None else None
        a.kdst, a.vdst = k_dst.data_ptr(), v_dst.data_ptr()
        a.kds[0], a.kds[1], a.vds[0], a.vds[1] = k_dst.stride(0), k_dst.stride(1), v_dst.stride(0), v_dst.stride(1)
    rc = load().kvrun_cb_attention(ctypes.byref(a))
    assert rc == 0, f"native cb_attention refused its arguments ({rc})"
    return out if q.dtype == torch.float32 else out.to(q.dtype)


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
