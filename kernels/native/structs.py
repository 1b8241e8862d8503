"""The C argument structs as ctypes mirrors, all in one module: args.h (and codec_desc.h's
Codec, gemv.h's Weight) declares them in C, this module field for field in the same
order. The two are held together at build and load time instead of by eye: the build
compiles `layout_source()`, a table of every mirrored struct's size and field offsets
generated from the `_fields_` below, and `check_layout(lib)` compares it with ctypes' own
before any call (native `load()` refuses a library that disagrees, naming the field).
A field added to one side only is therefore a load error, not a silently misread
argument. A ctypes name with a trailing underscore (`as_`) stands for the C name without it.
"""
from __future__ import annotations

import ctypes

_p = ctypes.c_void_p
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64


class CodecDesc(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("kind", "role", "bits", "G", "g", "rank", "k2", "mu_int8")] + [
        ("x", _p), ("xs", _i64 * 2),
        ("codes", _p), ("cs", _i64 * 4),
        ("hi", _p), ("hs", _i64 * 2),
        ("scale", _p), ("zero", _p), ("ss", _i64 * 3),
        ("mu", _p), ("mu_scale", _p), ("mus", _i64),
        ("lr_a", _p), ("as_", _i64 * 2),
        ("lr_b", _p), ("bs", _i64 * 3),
        ("oidx", _p), ("oval", _p), ("os", _i64 * 3),
        ("lv", ctypes.c_float * 16)]


class Args(ctypes.Structure):
    """decode_attention.c's `Args`; qint: KIVI q.K in int32 (decode_attention.c), 0 or 1;
    softcap: the attention logits' soft-cap (0: off)."""
    _fields_ = [(n, ctypes.c_int32) for n in ("Hkv", "R", "D", "Tq", "t0", "n_tail", "W", "Tn", "wdtype",
                                               "ndtype", "qdtype", "mass_lo", "Gq", "nthreads")] + [
        ("qin", _p), ("qs", _i64 * 2), ("q", _p), ("kw", _p), ("vw", _p), ("kws", _i64 * 2), ("vws", _i64 * 2),
        ("kn", _p), ("vn", _p), ("kns", _i64 * 2), ("vns", _i64 * 2),
        ("out", _p), ("sc", _p), ("part", _p), ("mass", _p), ("mass_stride", _i64),
        ("kc", ctypes.POINTER(CodecDesc)), ("vc", ctypes.POINTER(CodecDesc)),
        ("rk", _p), ("rv", _p), ("rq", _p), ("kb", _p), ("kdst", _p), ("vdst", _p), ("kds", _i64 * 2), ("vds", _i64 * 2),
        ("qint", ctypes.c_int32), ("softcap", ctypes.c_float)]


class RingStoreDesc(ctypes.Structure):
    """One role's storage: codes (L, Hkv, W, D*bits/8) uint8, scale / min (L, Hkv, W,
    D/group) fp16 (a 16-bit ring: rows (L, Hkv, W, D) in `codes`, no scale / min); strides
    layer, head, slot, of the codes in bytes, of scale and min in elements."""
    _fields_ = [("codes", _p), ("scale", _p), ("min", _p), ("cs", _i64 * 3), ("ss", _i64 * 3)]


class RingArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("Hkv", "Gq", "D", "n", "slot", "layer", "bits",
                                              "group", "qdtype", "kdtype", "vdtype", "rdtype",
                                              "nthreads")] + [
        ("q", _p), ("qs", _i64), ("kn", _p), ("vn", _p), ("kns", _i64), ("vns", _i64),
        ("k", RingStoreDesc), ("v", RingStoreDesc), ("rk", _p), ("rv", _p), ("out", _p),
        ("qp", _p), ("kx", _p), ("vx", _p), ("sc", _p), ("part", _p), ("softcap", ctypes.c_float)]


class WeightDesc(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("N", ctypes.c_int32), ("K", ctypes.c_int32),
                ("G", ctypes.c_int32), ("q", _p), ("s", _p), ("m", _p), ("scale", _p), ("bias", _p),
                ("rp", _p)]


class MoeDesc(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("E", "top_k", "inter", "norm_topk")] + [
        ("router", _p)] + [(n, ctypes.POINTER(WeightDesc)) for n in ("gate", "up", "down")] + [
        (n, _p) for n in ("probs", "chosen", "weight", "xg", "hg", "yg", "acc")]


class LayerDesc(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("hidden", "H", "Hkv", "D", "inter", "nthreads")] + [
        ("eps", ctypes.c_float), ("norm1", _p), ("norm2", _p)] + [
        (n, WeightDesc) for n in ("qkv", "o", "gate", "up", "down")] + [
        (n, _p) for n in ("x", "xn", "xsum", "qkv_out", "tmp", "h")] + [
        (n, _p) for n in ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")] + [
        ("act", ctypes.c_int32), ("q_scale", ctypes.c_float),
        ("xq", _p), ("ldq", ctypes.c_int64), ("gemv_int", ctypes.c_int32),
        ("qk_norm_proj", ctypes.c_int32), ("moe", ctypes.POINTER(MoeDesc))]


class RowCache(ctypes.Structure):
    _fields_ = [("args", ctypes.POINTER(_p)), ("n_tail", ctypes.POINTER(_i32)),
                ("n_win", ctypes.POINTER(_i32)), ("ring", ctypes.POINTER(ctypes.c_uint8)),
                ("ring_slot", _i32), ("ring_n", _i32)]


class StepDesc(ctypes.Structure):
    _fields_ = [("n_layers", _i32), ("nthreads", _i32),
                ("layers", ctypes.POINTER(ctypes.POINTER(LayerDesc))), ("local", _p)] + [
        (n, _p) for n in ("cos", "sin", "cos_local", "sin_local")] + [
        ("rows", ctypes.POINTER(ctypes.POINTER(RowCache))),
        ("attn", _p), ("qs", _p), ("sc", _p), ("part", _p),
        ("qs_row", ctypes.c_int64), ("sc_row", ctypes.c_int64), ("part_row", ctypes.c_int64), ("norm", _p),
        ("head", ctypes.POINTER(WeightDesc)), ("logits", _p)]


# (ctypes mirror, C type name), in the order `layout_source` lists them
MIRRORS = ((CodecDesc, "Codec"), (Args, "Args"), (RingStoreDesc, "RingStore"),
           (RingArgs, "RingArgs"), (WeightDesc, "Weight"), (MoeDesc, "Moe"), (LayerDesc, "Layer"),
           (RowCache, "RowCache"), (StepDesc, "Step"))


def _c_name(field: str) -> str:
    return field[:-1] if field.endswith("_") else field


def _expected() -> list[tuple[str, int]]:
    """(what, bytes) per table entry: each struct's size, then each field's offset."""
    out = []
    for cls, cname in MIRRORS:
        out.append((f"sizeof({cname})", ctypes.sizeof(cls)))
        out += [(f"{cname}.{_c_name(f)}", getattr(cls, f).offset) for f, _ in cls._fields_]
    return out


def layout_source() -> str:
    """C source of `kvrun_layout` (int64 per `_expected` entry) and `kvrun_layout_n`."""
    items = []
    for cls, cname in MIRRORS:
        items.append(f"sizeof({cname})")
        items += [f"offsetof({cname}, {_c_name(f)})" for f, _ in cls._fields_]
    rows = ",\n".join(f"    (int64_t){x}" for x in items)
    return ("/* generated by kernels/native/structs.py layout_source(): the mirrored structs' sizes\n"
            " * and offsets as C lays them out */\n"
            "#include <stddef.h>\n#include <stdint.h>\n#include \"args.h\"\n"
            f"const int64_t kvrun_layout[] = {{\n{rows}\n}};\n"
            "const int32_t kvrun_layout_n = (int32_t)(sizeof kvrun_layout / sizeof kvrun_layout[0]);\n")


def check_layout(lib) -> str | None:
    """None when every mirrored struct has C's size and offsets, else what differs first
    (one line). A library without the table (an old KVRUN_NATIVE_LIB) says so."""
    want = _expected()
    try:
        n = ctypes.c_int32.in_dll(lib, "kvrun_layout_n").value
        got = (ctypes.c_int64 * n).in_dll(lib, "kvrun_layout")
    except ValueError:
        return "the library has no kvrun_layout table (built from other sources)"
    if n != len(want):
        return f"the library's layout table has {n} entries, the ctypes mirror {len(want)}"
    for (what, w), g in zip(want, got):
        if w != g:
            return f"{what}: {g} bytes in C, {w} in the ctypes mirror (kernels/native/structs.py)"
    return None
