"""Backend choice for the decode-step ops (DESIGN §7): Triton on CUDA tensors; on CPU the
native C kernel (kernels/native/, built with gcc at first use) when it builds, else torch.

`KVRUN_BACKEND=triton|native|torch` forces one. Triton on CPU tensors runs only in Triton's
interpreter (`TRITON_INTERPRET=1`, read by triton when the kernels are first imported —
set it before anything imports kvrun.kernels.triton); without it, forcing triton on CPU is
an error rather than a silent fallback. The Triton module is imported lazily, so the torch
path never needs triton installed.

Per call, the torch path still runs when the Triton kernel does not cover the request: a
codec it does not read (`kvrun.kernels.triton.supports`), or an extra tensor argument the
Triton kernel does not know. The attention mass token eviction asks for (`mass=`,
`mass_from=`) is served by the Triton kernel too (a third launch over its logits).
`pack` (a flush of window tokens into the tail) has a Triton kernel for KIVI only
(`kivi_pack`, bit-identical storage); every other codec packs with torch on both backends.
`rope_compress_k` / `vproj_compress` (the fused write ops, DESIGN §7 ops 1-2) run their
Triton kernel for KIVI, TaDA and int8 codecs and torch for the rest (and on native/torch);
`vproj_compress` with weight None takes V rows as given (a weight-quantized v_proj).

What the model's decode step calls, per backend (runtime/kv/arena.py):
- triton and torch: `rope_compress_k` + `vproj_compress` (K's RoPE and the V projection
  fused into the window append and the flush), then `decode_attention` over tail + window
  (the arena's write-then-attend `write_attend`) — for layers whose K and V codecs
  `fused_compress.supports` (KIVI, TaDA, int8) and steps of T <= min(R, 64) tokens, not
  rotated, not evicting. GEAR, fp16/bf16/fp32 tails, rotation, eviction and prefill
  chunks: `decode_attention`, then `pack` per flushed block (attend-then-append).
- native: `attend_append` (one C call: rotate + round + window append + attention) on
  steps without a flush; otherwise `decode_attention`, then `pack`. The dense cache's
  one-token steps read their K/V through `decode_attention` too (an uncompressed tail).
  Around attention, int4/int8 models run the rest of the layer natively as well
  (runtime/decode_step.py: `kvrun_layer_pre` / `kvrun_layer_post` in native/decode_layer.c).
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


def rope_compress_k(x, cos, sin, win, w, codec, st, n_tail, R) -> int:
    """kernels.fused_compress.rope_compress_k on the chosen backend (the Triton kernel for
    KIVI / TaDA / int8 codecs, bit-identical storage; torch otherwise and on CPU)."""
    if backend_for(x) == "triton":
        from .triton import fused_compress as tfc
        if tfc.supports(codec):
            return tfc.rope_compress_k(x, cos, sin, win, w, codec, st, n_tail, R)
    from .fused_compress import rope_compress_k as rope_compress_k_torch
    return rope_compress_k_torch(x, cos, sin, win, w, codec, st, n_tail, R)


def vproj_compress(x, weight, bias, win, w, codec, st, n_tail, R) -> int:
    """kernels.fused_compress.vproj_compress on the chosen backend (as rope_compress_k);
    weight None: x is the V rows (Hkv, T, D), appended as given."""
    if backend_for(x) == "triton":
        from .triton import fused_compress as tfc
        if tfc.supports(codec):
            return tfc.vproj_compress(x, weight, bias, win, w, codec, st, n_tail, R)
    from .fused_compress import vproj_compress as vproj_compress_torch
    return vproj_compress_torch(x, weight, bias, win, w, codec, st, n_tail, R)
