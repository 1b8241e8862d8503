"""Backend choice for the decode-step ops: Triton on CUDA tensors; on CPU the native C
kernel (kernels/native/, built with gcc at first use) when it builds, else torch (the
path of a token through them: docs/architecture.md).

`KVRUN_BACKEND=triton|native|torch` forces one. Triton on CPU tensors runs only in Triton's
interpreter (`TRITON_INTERPRET=1`, read by triton when the kernels are first imported —
set it before anything imports kvrun.kernels.triton); without it, forcing triton on CPU is
an error rather than a silent fallback. The Triton module is imported lazily, so the torch
path never needs triton installed.

Which kernel serves which codec — the one place this is written down (the arena's
decode-step contract, the same order on every backend, is in runtime/kv/arena.py):

| op | triton (CUDA) | native (CPU) | torch |
|---|---|---|---|
| `decode_attention` (tail + window + new) | `triton.supports`: KIVI / TaDA / GEAR of 2, 4, 8 bits, int8, fp (eviction's `mass=` too) | fp, int8, KIVI, TaDA, GEAR (`native.decode_attention.describe`), batch 1, D <= 256, whole 32-token tiles | every codec (the oracle) |
| `attend_append` (window write fused into attention) | — (None: the caller writes first) | codecs `decode_attention` reads, rotation included | — |
| `rope_compress_k` / `vproj_compress` (K RoPE / V projection fused into the window write) | KIVI, TaDA, int8 (`fused_compress.supports`) | torch | torch (the oracle) |
| `ring_step` (a quantized sliding ring's one-token attend + slot write) | — (None: the torch step) | 4/8-bit rings, batch 1, D <= 256 (`native.ring_attention.supports`) | runtime/kv/ring.py (the oracle) |
| `pack` (a flush: window → tail) | KIVI 2/4-bit (`kivi_pack`), else `codec.store` | KIVI, TaDA, int8 (`native.pack`), else `codec.store` | `codec.store` |

The arena's step routes: torch and Triton take `write_attend` (`rope_compress_k` +
`vproj_compress` with flush=False, `decode_attention`, then `pack`) for layers whose K and
V codecs `fused_compress.supports` and steps of T <= min(R, 64) tokens that fit the
window, not rotated, not evicting; everything else (GEAR, fp16/bf16/fp32 tails, rotation,
eviction, long prefill chunks) and the native backend take `attend` (`attend_append` or
`decode_attention`, then `pack`). The dense cache's one-token steps read K/V through
native `decode_attention` as an uncompressed tail. Around attention, int4/int8 models run
the rest of the layer natively too (runtime/model/native_step.py: `kvrun_layer_pre` /
`kvrun_layer_post` in native/decode_layer.c). A request a kernel does not cover falls back
to torch per call; `pack` storage is bit-identical on every backend, and the write ops'
Triton kernels are bit-identical to their torch oracle.
"""
from __future__ import annotations

import os

import torch

from . import native
from .decode_attention import decode_attention as decode_attention_torch

BACKENDS = ("triton", "native", "torch")


class BackendError(RuntimeError):
    """The requested backend cannot run here (one-line message for the user)."""


def backend_for(x: torch.Tensor) -> str:
    """'triton', 'native' or 'torch' for an op on tensor x (honours KVRUN_BACKEND)."""
    want = os.environ.get("KVRUN_BACKEND", "").strip().lower()
    if want and want not in BACKENDS:
        raise BackendError(f"KVRUN_BACKEND={want!r}: expected one of {', '.join(BACKENDS)}")
    if want == "torch":
        return "torch"
    if want == "native":
        if x.is_cuda:
            raise BackendError("KVRUN_BACKEND=native runs on CPU tensors only")
        if native.load() is None:
            raise BackendError(f"KVRUN_BACKEND=native: the native kernels did not build ({native.error()})")
        return "native"
    if want == "triton":
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise BackendError("KVRUN_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 "
                               "(Triton's interpreter); use a CUDA device or KVRUN_BACKEND=torch")
        _triton()
        return "triton"
    if x.is_cuda:
        return "triton" if _triton(required=False) is not None else "torch"
    return "native" if native.load() is not None else "torch"


def _triton(required: bool = True):
    try:
        from . import triton as tri                     # kvrun.kernels.triton (imports triton)
    except ImportError as e:
        if required:
            raise BackendError(f"the Triton backend needs the triton package ({e})") from e
        return None
    return tri


def decode_attention(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, **kw):
    """kernels.decode_attention on the chosen backend (same arguments and result)."""
    extra = {k: v for k, v in kw.items() if k not in ("block", "q_chunk", "mass", "mass_from")}
    be = backend_for(q)
    if be == "native":
        from .native.decode_attention import decode_attention as decode_attention_native
        out = decode_attention_native(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, **kw)
        if out is not None:                 # None: a request the C kernel does not cover
            return out
    if be == "triton" and not any(isinstance(v, torch.Tensor) for v in extra.values()):
        tri = _triton()
        if n_tail == 0 or (tri.supports(k_tail[0]) and tri.supports(v_tail[0])):
            return tri.decode_attention(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new,
                                        mass=kw.get("mass"), mass_from=kw.get("mass_from", 0))
    return decode_attention_torch(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, **kw)


def attend_append(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, k_dst, v_dst,
                  rot_k=None, rot_v=None, **kw):
    """The arena's decode step as one op where the backend has it fused (native CPU:
    rotate + round + window append + attention, kernels/native/decode_attention.py
    `attend_append`); None elsewhere, and the caller runs the steps one by one."""
    if backend_for(q) != "native":
        return None
    from .native.decode_attention import attend_append as fused
    return fused(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, k_dst, v_dst,
                 rot_k, rot_v, **kw)


def ring_step(q, k, v, k_parts, v_parts, bits, group, dtype, layer, slot, n, rot_v=None):
    """A quantized sliding ring's one-token step as one op where the backend has it (native
    CPU: attention over the codes in place + the new rows quantized into their slot, bit-
    identical storage; kernels/native/ring_attention.py `ring_step`); None elsewhere, and
    the caller runs the torch step (runtime/kv/ring.py)."""
    if backend_for(q) != "native":
        return None
    from .native.ring_attention import ring_step as fused
    return fused(q, k, v, k_parts, v_parts, bits, group, dtype, layer, slot, n, rot_v)


def pack(codec, st: dict, x: torch.Tensor, s0: int) -> None:
    """codec.pack(st, x, s0) on the chosen backend: x (Hkv, n, D) into tail tokens
    [s0, s0+n). Writes the storage only (bit-identical on both backends); use codec.dequant
    for the reconstruction."""
    be = backend_for(x)
    if be == "native":
        from .native import pack as native_pack
        if native_pack.supports(codec) and native_pack.store(codec, st, x, s0):
            return
    if be == "triton":
        tri = _triton()
        if tri.kivi_pack_supports(codec):
            tri.kivi_pack(codec, st, x, s0)
            return
    codec.store(st, x, s0)


def rope_compress_k(x, cos, sin, win, w, codec, st, n_tail, R, flush=True) -> int:
    """kernels.fused_compress.rope_compress_k on the chosen backend (the Triton kernel for
    KIVI / TaDA / int8 codecs, bit-identical storage; torch otherwise and on CPU)."""
    if backend_for(x) == "triton":
        from .triton import fused_compress as tfc
        if tfc.supports(codec):
            return tfc.rope_compress_k(x, cos, sin, win, w, codec, st, n_tail, R, flush)
    from .fused_compress import rope_compress_k as rope_compress_k_torch
    return rope_compress_k_torch(x, cos, sin, win, w, codec, st, n_tail, R, flush)


def vproj_compress(x, weight, bias, win, w, codec, st, n_tail, R, flush=True) -> int:
    """kernels.fused_compress.vproj_compress on the chosen backend (as rope_compress_k);
    weight None: x is the V rows (Hkv, T, D), appended as given."""
    if backend_for(x) == "triton":
        from .triton import fused_compress as tfc
        if tfc.supports(codec):
            return tfc.vproj_compress(x, weight, bias, win, w, codec, st, n_tail, R, flush)
    from .fused_compress import vproj_compress as vproj_compress_torch
    return vproj_compress_torch(x, weight, bias, win, w, codec, st, n_tail, R, flush)
