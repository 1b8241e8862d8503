"""The decode-step ops, each run on a backend: Triton on CUDA tensors; on CPU the native C
kernel (kernels/native/, built with gcc at first use) when it builds, else torch.

The backend is chosen once: `select(device)` reads `KVRUN_BACKEND=triton|native|torch`
(which forces one) when a cache is built, and the cache passes its choice to every op
(`backend=`); an op called without one asks `backend_for(x)`. Triton on CPU tensors runs
only in Triton's interpreter (`TRITON_INTERPRET=1`, read by triton when the kernels are
first imported); without it, forcing triton on CPU is an error rather than a silent
fallback. The Triton module is imported lazily, so the torch path never needs triton.
`gemv_path()` reads `KVRUN_GEMV=fp32|int` the same way, once, when a model's native decode
step is built: its GEMVs on int16-quantized inputs (the default) or in fp32 (the reference).
`attn_path()` reads `KVRUN_ATTN=fp32|int` for the native attention ops below the same way:
once, when a cache is built (the cache passes its `attn` to every op, as its backend; an op
called without one reads it then): KIVI keys' q.K in int32 over
int16-quantized queries, a KIVI V's p.V with its scales folded into the weights (the
default), or both in fp32 as the codes dequantize (the reference).

Which backend has a kernel for which codec, per op, and which route a cache's step takes:
kernels/table.py, the one place that says so; kernels/backend.py resolves each cache layer's
route from it, and from the layer's shape, when the cache is built. An op given a `backend=`
(a route's) runs on it: a kernel that declines such a call raises `KernelRouteError` (the
route promised what it cannot do: a bug, never a silent detour). Only an op called without
one (tools, tests) picks per call, falling back to torch where a kernel declines the shape.
`pack` storage is bit-identical on every backend.
"""
from __future__ import annotations

import os

import torch

from .. import knobs
from . import native
from .decode_attention import decode_attention as decode_attention_torch
from .hadamard import rotate_step
from .native.decode_attention import ATTN_PATHS          # ("fp32", "int"): attn_path's choices
from .native.decode_attention import fused_rows

BACKENDS = ("triton", "native", "torch")
GEMV_PATHS = ("fp32", "int")                # kernels/native/decode_layer.py


class BackendError(RuntimeError):
    """The requested backend cannot run here (one-line message for the user)."""


class KernelRouteError(AssertionError):
    """A kernel declined a call its resolved route gave it (module docstring): the route and
    the kernel's coverage disagree."""


def select(device="cpu") -> str:
    """'triton', 'native' or 'torch' for ops on `device`, honouring KVRUN_BACKEND. Chosen
    once: a cache calls this at construction and passes its answer to every op below
    (`backend=`), so the environment is read when a model or cache is built, not per step."""
    want = knobs.backend()
    if want and want not in BACKENDS:
        raise BackendError(f"KVRUN_BACKEND={want!r}: expected one of {', '.join(BACKENDS)}")
    cuda = torch.device(device).type == "cuda"
    if want == "torch":
        return "torch"
    if want == "native":
        if cuda:
            raise BackendError("KVRUN_BACKEND=native runs on CPU tensors only")
        if native.load() is None:
            raise BackendError(f"KVRUN_BACKEND=native: the native kernels did not build ({native.error()})")
        return "native"
    if want == "triton":
        if not cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise BackendError("KVRUN_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 "
                               "(Triton's interpreter); use a CUDA device or KVRUN_BACKEND=torch")
        _triton()
        return "triton"
    if cuda:
        return "triton" if _triton(required=False) is not None else "torch"
    return "native" if native.load() is not None else "torch"


def gemv_path() -> str:
    """'int' (the default) or 'fp32', honouring KVRUN_GEMV: how the native decode step's
    GEMVs multiply (kernels/native/decode_layer.py). Read when the step is built. An input
    that sits on a rounding boundary of its int16 code moves the logits (by ~1e-3; with the
    former int8 codes by up to ~0.2-0.5), so everything upstream of a GEMV must be the same
    bits whatever the thread count (the
    attention kernels split a cache by its length, not by the threads:
    tests/model/test_thread_invariance.py). fp32 is the reference the model tests compare with
    the eager forward."""
    want = knobs.gemv() or "int"
    if want not in GEMV_PATHS:
        raise BackendError(f"KVRUN_GEMV={want!r}: expected one of {', '.join(GEMV_PATHS)}")
    return want


_ATTN_DEFAULT: list = []


def _default_attn() -> str:
    """'int' when the native build's integer dot products are AVX512-VNNI or AVX2, else 'fp32'
    (read once): the plain C integer loop is slower than the fp32 kernel."""
    if not _ATTN_DEFAULT:
        lib = native.load()
        _ATTN_DEFAULT.append("int" if lib is not None and lib.kvrun_gemv_isa() >= 1 else "fp32")
    return _ATTN_DEFAULT[0]


def attn_path() -> str:
    """'int' (the default) or 'fp32', honouring KVRUN_ATTN: how the native attention kernel
    multiplies KIVI and int8 caches (kernels/native/decode_attention.py `decode_attention`).
    int: per query row and 32-token tile the row folded with the tile's channel scales, q s,
    is quantized to int16 with one scale and dotted with the 2/3/4-bit codes in int32 (a logit
    moves by at most half a step, max|q s| / 32767, times the sum of the codes: ~1e-4 of its
    spread; int8 keys: the row quantized once, no fold), and p.V quantizes the weights p s of
    a row, channel group and run of up to 256 tokens to int16 and sums them over the codes in
    int32, adding sum p z in fp32. Like the GEMVs, each row's
    result is the same bits on any thread count. fp32 is the reference the kernel tests
    compare with the dequantized cache. Unset, int where the native build has AVX512-VNNI or
    AVX2 and fp32 in plain C, whose integer loop is slower than its fp32 kernel."""
    want = knobs.attn() or _default_attn()
    if want not in ATTN_PATHS:
        raise BackendError(f"KVRUN_ATTN={want!r}: expected one of {', '.join(ATTN_PATHS)}")
    return want


def backend_for(x: torch.Tensor) -> str:
    """select(x.device): the backend for an op called without `backend=`."""
    return select(x.device)


def _triton(required: bool = True):
    try:
        from . import triton as tri                     # kvrun.kernels.triton (imports triton)
    except ImportError as e:
        if required:
            raise BackendError(f"the Triton backend needs the triton package ({e})") from e
        return None
    return tri


def decode_attention(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, backend=None,
                     attn=None, softcap: float = 0.0, **kw):
    """kernels.decode_attention on `backend` (None: backend_for(q)); same arguments and
    result. attn: the native kernel's product path (None: attn_path()); softcap: the
    logits' soft-cap cap·tanh(s / cap) before the softmax (0: off), on every backend."""
    be = backend or backend_for(q)
    if be == "native":
        from .native.decode_attention import decode_attention as decode_attention_native
        out = decode_attention_native(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new,
                                      attn=attn or attn_path(), softcap=softcap, **kw)
        if out is not None:
            return out
        _declined(backend, "decode_attention", k_tail, v_tail, n_tail, q)
    if be == "triton":
        tri = _triton()
        if backend is not None or n_tail == 0 or (tri.supports(k_tail[0]) and tri.supports(v_tail[0])):
            return tri.decode_attention(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new,
                                        mass=kw.get("mass"), mass_from=kw.get("mass_from", 0),
                                        softcap=softcap)
    return decode_attention_torch(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new,
                                  softcap=softcap, **kw)


def _declined(backend, op: str, k_tail, v_tail, n_tail: int, q) -> None:
    """A kernel returned None: an error for a routed call (`backend` given), else the caller
    goes on to torch."""
    if backend is not None:
        raise KernelRouteError(f"the {backend} {op} kernel declined a call its route gave it: "
                               f"K {k_tail[0].method}, V {v_tail[0].method}, {n_tail} tail tokens, "
                               f"q {tuple(q.shape)}")


def attend_append(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, k_dst, v_dst,
                  rot_k=None, rot_v=None, attn=None, softcap: float = 0.0, **kw):
    """The arena's decode step as one native kernel call (rotate + round + window append +
    attention, kernels/native/decode_attention.py `attend_append`): a `fused` route's op
    (kernels/backend.py), for T new tokens that `fused_fits`. A call the kernel declines
    raises `KernelRouteError`."""
    from .native.decode_attention import attend_append as fused
    o = fused(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, k_dst, v_dst,
              rot_k, rot_v, attn=attn or attn_path(), softcap=softcap, **kw)
    if o is None:
        _declined("native", "attend_append", k_tail, v_tail, n_tail, q)
    return o


def fused_fits(H: int, N: int, T: int) -> bool:
    """Whether `attend_append` takes T new tokens of H query heads over N keys in one call
    (its query block; the window's room is the caller's to check)."""
    return T <= fused_rows(H, N)


def fused_step(win_k, win_v, layer: int, H: int, rot_k=None, rot_v=None, attn=None,
               softcap: float = 0.0):
    """`attend_append` for one token of one arena layer with its arguments built once, a
    callable (q, k_tail, v_tail, n_tail, w, k, v, mass=, mass_from=) -> o, or None for q /
    k / v whose channels are not contiguous (the caller then takes `attend_append`, the same
    kernel with its arguments built per call): kernels/native/decode_attention.py
    `FusedStep`, a `fused` route's op."""
    from .native.decode_attention import fused_step as native_fused_step
    return native_fused_step(win_k, win_v, layer, H, rot_k, rot_v, attn or attn_path(), softcap)


def step_row(H: int, group: int, layers: list, ring: tuple | None = None,
             attn=None, softcap: float = 0.0):
    """A cache's layers as one row of the one-call decode step (native CPU:
    kernels/native/decode_step.py `RowPlan`), for a cache whose arena layers are all
    `fused` (kernels/backend.py) beside rings whose route is native; a layer the kernels
    decline raises `KernelRouteError`. group: the tail grows by multiples
    of it; layers: per layer (k_tail, v_tail, k_win, v_win, rot_k, rot_v), the windows
    (Hkv, cap, D), as `fused_step` takes them — or None for a sliding ring layer, the j-th
    None being ring layer j of `ring` = (k_parts, v_parts, D, bits, group, dtype, rot_k,
    rot_v, softcap), as `ring_step` takes them. attn: the kernel's product path (None:
    attn_path()); the caller rebuilds the row when its own changes. softcap: the arena
    layers' logit soft-cap (0: off)."""
    from .native.decode_step import row_plan
    plan = row_plan(H, group, layers, attn or attn_path(), ring, softcap)
    if plan is None:
        raise KernelRouteError(f"the native decode step declined a row its routes gave it "
                               f"({len(layers)} layers, group {group}, {H} query heads)")
    return plan


def ring_step(q, k, v, k_parts, v_parts, bits, group, dtype, layer, slot, n, rot_k=None,
              rot_v=None, backend=None, softcap: float = 0.0):
    """A sliding ring's one-token step as one op where the backend has it: q, k, v (the
    model's space) rotated by rot_k / rot_v, attention over the rows or codes in place + the
    new rows rounded (quantized) into their slot, the output un-rotated (native CPU, every
    ring width: kernels/native/ring_attention.py `ring_step`, the rotations inside its call;
    Triton, 4/8-bit rings: kernels/triton/ring_attention.py `ring_step` after `rotate_step`);
    softcap > 0 soft-caps the logits to cap·tanh(s / cap) before the softmax.
    None on torch and for 16-bit rings on Triton (no kernel: the caller runs the torch step,
    runtime/kv/ring.py). Called with the ring's route (`backend=`, kernels/backend.py
    `ring_route`), a call its kernel declines raises `KernelRouteError`; without one, such a
    call returns None too."""
    be = backend or backend_for(q)
    o = None
    if be == "native":
        from .native.ring_attention import ring_step as fused
        o = fused(q, k, v, k_parts, v_parts, bits, group, dtype, layer, slot, n, rot_k, rot_v,
                  softcap)
    elif be == "triton" and bits != 16:
        q, k, v = rotate_step(q, k, v, rot_k, rot_v)
        o = _triton().ring_step(q, k, v, k_parts, v_parts, bits, group, dtype, layer, slot, n, rot_v,
                                softcap=softcap)
    else:
        return None                     # no kernel here (torch): the caller's torch step
    if o is None and backend is not None:
        raise KernelRouteError(f"the {backend} ring_step kernel declined a call its route gave it: "
                               f"{bits}-bit ring, q {tuple(q.shape)}, k {tuple(k.shape)}")
    return o


def pack(codec, st: dict, x: torch.Tensor, s0: int, backend=None, mu=None) -> None:
    """codec.pack(st, x, s0) on the chosen backend: x (Hkv, n, D) into tail tokens
    [s0, s0+n). Writes the storage only (bit-identical on every backend); use codec.dequant
    for the reconstruction. mu: per-token means (n, D) to store instead of computing them
    (NaN: computed), for codecs that keep one (TaDA: token eviction's shared-slot re-pack);
    no kernel takes them, so that pack runs on torch (kernels/table.py, `pack_means`)."""
    if mu is not None:                  # `pack_means`: no kernel takes given means
        codec.pack(st, x, s0, mu=mu)
        return
    be = backend or backend_for(x)
    if be == "native":
        from .native import pack as native_pack
        if native_pack.store(codec, st, x, s0):      # False: a codec or shape it does not take
            return
        if backend is not None:
            raise KernelRouteError(f"the native pack declined a flush its route gave it: "
                                   f"{codec.method}, {x.shape[1]} tokens at {s0}")
    if be == "triton":
        tri = _triton()
        if backend is not None or tri.kivi_pack_supports(codec):
            tri.kivi_pack(codec, st, x, s0)
            return
    codec.store(st, x, s0)


def write_k(x, cos, sin, win, w, backend=None) -> None:
    """kernels.window_write.write_k on the chosen backend: new K rows x (Hkv, T, D) with
    RoPE into window slots [w, w + T) (the Triton kernel, bit-identical rows; torch
    otherwise and on CPU)."""
    if (backend or backend_for(x)) == "triton":
        from .triton import window_write as tww
        return tww.write_k(x, cos, sin, win, w)
    from .window_write import write_k as write_k_torch
    return write_k_torch(x, cos, sin, win, w)


def write_v(x, weight, bias, win, w, backend=None) -> None:
    """kernels.window_write.write_v on the chosen backend (as write_k); weight None: x is
    the V rows (Hkv, T, D), written as given."""
    if (backend or backend_for(x)) == "triton":
        from .triton import window_write as tww
        return tww.write_v(x, weight, bias, win, w)
    from .window_write import write_v as write_v_torch
    return write_v_torch(x, weight, bias, win, w)
