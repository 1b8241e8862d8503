"""A sliding-window ring's one-token step on the native kernel (ring_attention.c): q, the
new K and V rotated into the ring's space, attention over the ring's rows or codes read in
place, the new row in full precision, the new K/V rows rounded (and quantized) into their
slot, the output un-rotated — one C call per layer (`ring_step`, the per-layer route), or
every ring layer of a cache inside the one-call decode step (`step_args`,
native/decode_step.py).

Same output as runtime/kv/ring.py's torch step (`rotate_step`, `SlidingWindowKV._attend`
with T == 1, then `unrotate`) up to fp32 summation order (attention's dots and sums run in
another order than SDPA's). The stored bytes — codes, scales and mins, or a 16-bit ring's
rows — are bit-identical to the torch step's `_RingStore.write` on every CPU: the rotation
is the signed Hadamard's butterfly (hadamard.Hadamard) in the same fixed order of fp32
operations on both sides, where a matrix product's sum order is the BLAS library's.
"""
from __future__ import annotations

import ctypes
import weakref

import torch

from . import load
from ..hadamard import Hadamard
from .structs import RingArgs, RingStoreDesc  # noqa: F401  (the C structs, mirrored in one place)

_FP = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
MAX_D, MAX_GQ = 256, 16

_p = ctypes.c_void_p
_i64 = ctypes.c_int64




def _store(parts) -> RingStoreDesc:
    codes = parts[0]
    assert codes.stride(3) == 1, "ring storage: channel-contiguous rows"
    cs = tuple(x * codes.element_size() for x in codes.stride()[:3])
    if len(parts) == 1:                                 # a 16-bit ring's rows
        return RingStoreDesc(codes.data_ptr(), None, None, cs, (0, 0, 0))
    _, scale, mn = parts
    assert codes.dtype == torch.uint8 and scale.dtype == mn.dtype == torch.float16
    assert scale.stride(3) == 1 and scale.stride() == mn.stride(), \
        "ring storage: channel-contiguous codes, scale and min of one layout"
    return RingStoreDesc(codes.data_ptr(), scale.data_ptr(), mn.data_ptr(), cs, tuple(scale.stride()[:3]))


def _rotation(r):
    """A ring's rotation as the kernel reads it: the signs (D,) fp32 of a hadamard.Hadamard,
    applied by the butterfly in the order the torch step's `fwht` runs (None: none)."""
    if r is None:
        return None
    assert isinstance(r, Hadamard), "a ring rotates by a hadamard.Hadamard (its signs)"
    return r.signs.float().contiguous()


class _Plan:
    """The C arguments of one ring (storage pointers, rotations, scratch) built once; a call
    fills in the per-step fields."""

    def __init__(self, k_parts, v_parts, D, bits, group, dtype, rot_k, rot_v):
        Hkv, W = k_parts[0].shape[1:3]
        self.W, self.D = W, D
        self.a = a = RingArgs()
        a.Hkv, a.D, a.bits, a.group, a.rdtype = Hkv, D, bits, group, _FP[dtype]
        a.k, a.v = _store(k_parts), _store(v_parts)
        self.rk, self.rv = _rotation(rot_k), _rotation(rot_v)
        a.rk = self.rk.data_ptr() if self.rk is not None else None
        a.rv = self.rv.data_ptr() if self.rv is not None else None
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


_PLANS: dict = {}       # (id(K codes), id(rot_k), id(rot_v)) -> (weakref to the codes, _Plan)


def _plan(k_parts, v_parts, D, bits, group, dtype, rot_k, rot_v) -> _Plan:
    """One plan per ring storage, alive as long as its codes tensor (a weak reference checks
    it is the same live tensor, so a reused id never returns stale pointers)."""
    t = k_parts[0]
    key = (id(t), id(rot_k), id(rot_v))
    hit = _PLANS.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    p = _Plan(k_parts, v_parts, D, bits, group, dtype, rot_k, rot_v)
    _PLANS[key] = (weakref.ref(t, lambda _, k=key: _PLANS.pop(k, None)), p)
    return p


def covers(H: int, Hkv: int, D: int, bits: int, group: int, dtype) -> bool:
    """Whether the kernel takes a ring of these shapes: 4- or 8-bit codes in channel groups
    dividing D, or 16-bit rows; head dim <= 256, at most 16 query heads per KV head,
    fp16/bf16/fp32 rows; the library built."""
    return (bits in (4, 8, 16) and D <= MAX_D and (bits == 16 or D % group == 0)
            and (bits != 4 or D % 2 == 0) and H % Hkv == 0 and H // Hkv <= MAX_GQ
            and dtype in _FP and load() is not None)


def supports(q, k, v, bits: int, group: int, dtype) -> bool:
    """Whether the kernel covers this step: one token of batch 1 on CPU, a ring `covers`
    takes, q / k / v of a row dtype with contiguous channels."""
    _, H, T, D = q.shape
    return (T == 1 and q.shape[0] == 1 and q.device.type == "cpu"
            and all(x.dtype in _FP and x.stride(3) == 1 for x in (q, k, v))
            and covers(H, k.shape[1], D, bits, group, dtype))


def ring_step(q, k, v, k_parts, v_parts, bits: int, group: int, dtype, layer: int, slot: int,
              n: int, rot_k=None, rot_v=None, softcap: float = 0.0):
    """One decode token of a ring layer. q (1, H, 1, D), k and v (1, Hkv, 1, D) in the
    model's space (K after RoPE); rot_k / rot_v the ring's rotations of K (q and k) and V,
    or None; k_parts / v_parts the storage tensors of every sliding layer (ring.py
    `ring_layout`: (codes, scale, min), or a 16-bit ring's rows), (L, Hkv, W, ·); dtype the
    ring's row dtype (the new rows are rounded to it). Writes the new rows into `slot` of
    `layer`, attends over slots 0 .. n-1 (slot `slot` the new rows in full precision) and
    returns (1, H, 1, D) in q's dtype, in the model's space; softcap > 0 soft-caps the
    logits to cap tanh(s / cap) before the softmax. None when not covered (the caller then
    runs the torch step)."""
    if not supports(q, k, v, bits, group, dtype):
        return None
    _, H, _, D = q.shape
    Hkv = k.shape[1]
    p = _plan(k_parts, v_parts, D, bits, group, dtype, rot_k, rot_v)
    p.scratch(H)
    a = p.a
    out = torch.empty(1, H, 1, D)
    a.Gq, a.n, a.slot, a.layer, a.nthreads = H // Hkv, n, slot, layer, torch.get_num_threads()
    a.softcap = softcap
    a.qdtype, a.kdtype, a.vdtype = _FP[q.dtype], _FP[k.dtype], _FP[v.dtype]
    a.q, a.qs = q.data_ptr(), q.stride(1)
    a.kn, a.kns, a.vn, a.vns = k.data_ptr(), k.stride(1), v.data_ptr(), v.stride(1)
    a.out = out.data_ptr()
    rc = load().kvrun_ring_attention(ctypes.byref(a))
    assert rc == 0, f"native ring_attention refused its arguments ({rc})"
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def step_args(H: int, k_parts, v_parts, D: int, bits: int, group: int, dtype, rot_k=None,
              rot_v=None, softcap: float = 0.0):
    """The arguments of every ring layer's one-token step inside the one-call decode step
    (native/decode_step.py RowPlan; C kvrun_ring_attention_rows binds q / k / v / out, the
    scratch, slot and n per step): one RingArgs per sliding layer, in order, fp32 q and new
    rows of head stride D, as the per-layer route's `ring_step` gets them from the layer
    scratch, and its softcap; they share the rotations and the kx / vx scratch (a row's
    layers run one after another). Returns (list of RingArgs, what they point into), or None when `covers`
    declines."""
    L, Hkv = k_parts[0].shape[:2]
    if not covers(H, Hkv, D, bits, group, dtype):
        return None
    p = _Plan(k_parts, v_parts, D, bits, group, dtype, rot_k, rot_v)
    base = p.a
    base.Gq, base.softcap = H // Hkv, softcap
    base.qdtype = base.kdtype = base.vdtype = _FP[torch.float32]
    base.qs = base.kns = base.vns = D
    args = []
    for layer in range(L):
        a = RingArgs.from_buffer_copy(base)
        a.layer = layer
        args.append(a)
    return args, p
