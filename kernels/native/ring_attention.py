"""The quantized sliding-window ring's one-token step on the native kernel
(ring_attention.c): attention over the ring's codes read in place, the new row in full
precision, and the new K/V rows quantized into their slot — one C call per layer.

Same result as runtime/kv/ring.py's torch step (`SlidingWindowKV._attend` with T == 1,
then `unrotate`), up to fp32 summation order (the torch step rounds the dequantized rows,
q and the output to the ring dtype for SDPA; this kernel keeps them in fp32), and the same
stored bytes: codes, scales and mins are bit-identical to `_RingStore.write`.
"""
from __future__ import annotations

import ctypes
import weakref

import torch

from . import load

_FP = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
MAX_D, MAX_GQ = 256, 16

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


class RingStoreDesc(ctypes.Structure):
    """One role's storage: codes (L, Hkv, W, D*bits/8) uint8, scale / min (L, Hkv, W,
    D/group) fp16; element strides layer, head, slot."""
    _fields_ = [("codes", _p), ("scale", _p), ("min", _p), ("cs", _i64 * 3), ("ss", _i64 * 3)]


class RingArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("Hkv", "Gq", "D", "n", "slot", "layer", "bits",
                                              "group", "qdtype", "kdtype", "vdtype", "rdtype",
                                              "nthreads")] + [
        ("q", _p), ("qs", _i64), ("kn", _p), ("vn", _p), ("kns", _i64), ("vns", _i64),
        ("k", RingStoreDesc), ("v", RingStoreDesc), ("rvt", _p), ("out", _p),
        ("qp", _p), ("kx", _p), ("vx", _p), ("sc", _p), ("part", _p)]


def _store(codes, scale, mn) -> RingStoreDesc:
    assert codes.dtype == torch.uint8 and scale.dtype == mn.dtype == torch.float16
    assert codes.stride(3) == 1 and scale.stride(3) == 1 and scale.stride() == mn.stride(), \
        "ring storage: channel-contiguous codes, scale and min of one layout"
    return RingStoreDesc(codes.data_ptr(), scale.data_ptr(), mn.data_ptr(),
                         tuple(codes.stride()[:3]), tuple(scale.stride()[:3]))


class _Plan:
    """The C arguments of one ring (storage pointers, scratch) built once; a call fills in
    the per-step fields."""

    def __init__(self, k_parts, v_parts, bits, group, dtype, rot_v):
        codes = k_parts[0]
        _, Hkv, W, _ = codes.shape
        D = k_parts[1].shape[3] * group
        self.W, self.D = W, D
        self.a = RingArgs()
        a = self.a
        a.Hkv, a.D, a.bits, a.group, a.rdtype = Hkv, D, bits, group, _FP[dtype]
        a.k, a.v = _store(*k_parts), _store(*v_parts)
        self.rvt = rot_v.float().T.contiguous() if rot_v is not None else None
        a.rvt = self.rvt.data_ptr() if self.rvt is not None else None
        self.kx, self.vx = torch.empty(Hkv * D), torch.empty(Hkv * D)
        a.kx, a.vx = self.kx.data_ptr(), self.vx.data_ptr()
        self.H = 0

    def scratch(self, H: int) -> None:
        """Scratch for H query heads (grown, never shrunk); the partial outputs of the C
        kernel's slot splits, at most kvrun_ring_splits_max of them whatever the threads."""
        if H <= self.H:
            return
        self.H, D = H, self.D
        self.qp, self.sc, self.part = torch.empty(H * D), torch.empty(H * self.W), \
            torch.empty(load().kvrun_ring_splits_max() * H * D)
        self.a.qp, self.a.sc, self.a.part = self.qp.data_ptr(), self.sc.data_ptr(), self.part.data_ptr()


_PLANS: dict = {}       # (id(K codes), id(rot_v)) -> (weakref to the codes, _Plan)


def _plan(k_parts, v_parts, bits, group, dtype, rot_v) -> _Plan:
    """One plan per ring storage, alive as long as its codes tensor (a weak reference checks
    it is the same live tensor, so a reused id never returns stale pointers)."""
    t = k_parts[0]
    key = (id(t), id(rot_v))
    hit = _PLANS.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    p = _Plan(k_parts, v_parts, bits, group, dtype, rot_v)
    _PLANS[key] = (weakref.ref(t, lambda _, k=key: _PLANS.pop(k, None)), p)
    return p


def supports(q, k, v, bits: int, group: int, dtype) -> bool:
    """Whether the kernel covers this step: one token of batch 1 on CPU, 4- or 8-bit codes,
    head dim <= 256, at most 16 query heads per KV head, fp16/bf16/fp32 rows."""
    _, H, T, D = q.shape
    Hkv = k.shape[1]
    return (T == 1 and q.shape[0] == 1 and q.device.type == "cpu" and bits in (4, 8)
            and D <= MAX_D and D % group == 0 and H % Hkv == 0 and H // Hkv <= MAX_GQ
            and all(x.dtype in _FP and x.stride(3) == 1 for x in (q, k, v)) and dtype in _FP
            and load() is not None)


def ring_step(q, k, v, k_parts, v_parts, bits: int, group: int, dtype, layer: int, slot: int,
              n: int, rot_v=None):
    """One decode token of a quantized ring layer. q (1, H, 1, D) and k (1, Hkv, 1, D) rotated
    by the ring's K rotation, v (1, Hkv, 1, D) rotated by rot_v when given; k_parts / v_parts
    the (codes, scale, min) tensors of every sliding layer, (L, Hkv, W, ·); dtype the ring's
    row dtype (the new rows are rounded to it). Writes the new rows into `slot` of `layer`,
    attends over slots 0 .. n-1 (slot `slot` the new rows in full precision) and returns
    (1, H, 1, D) in q's dtype, un-rotated by rot_v. None when not covered (the caller then
    runs the torch step)."""
    if not supports(q, k, v, bits, group, dtype):
        return None
    _, H, _, D = q.shape
    Hkv = k.shape[1]
    p = _plan(k_parts, v_parts, bits, group, dtype, rot_v)
    nth = torch.get_num_threads()
    p.scratch(H)
    a = p.a
    out = torch.empty(1, H, 1, D)
    a.Gq, a.n, a.slot, a.layer, a.nthreads = H // Hkv, n, slot, layer, nth
    a.qdtype, a.kdtype, a.vdtype = _FP[q.dtype], _FP[k.dtype], _FP[v.dtype]
    a.q, a.qs = q.data_ptr(), q.stride(1)
    a.kn, a.kns, a.vn, a.vns = k.data_ptr(), k.stride(1), v.data_ptr(), v.stride(1)
    a.out = out.data_ptr()
    rc = load().kvrun_ring_attention(ctypes.byref(a))
    assert rc == 0, f"native ring_attention refused its arguments ({rc})"
    return out if q.dtype == torch.float32 else out.to(q.dtype)
