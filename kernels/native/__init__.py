"""Native CPU kernels: C compiled with the machine's gcc at first use, called with ctypes.

Why: on CPU every torch op of the decode step costs 5-10 µs of dispatch, and the packed
formats need several ops per block (unpack, scale, GEMM, reorder), so a compressed cache
read through torch ops is slower than fp16 SDPA even though it reads 3-4x fewer bytes.
One C call per layer reads the packed codes in place (decode_attention.c).

The shared object is built once per source/compiler/flags into
$KVRUN_HOME/native (default ~/.cache/kvrun/native), written to a temporary name and
renamed, so concurrent first uses never load a half-written file. It links torch's own
libgomp (the same soname is already loaded by torch), so its OpenMP threads are torch's.
When gcc is missing or the build fails, `load()` returns None and callers use the torch
implementation; `error()` says why. `KVRUN_NATIVE=0` disables the native kernels;
`KVRUN_NATIVE=portable` loads the build without AVX-512 (-DKVRUN_NO_AVX512);
`KVRUN_NATIVE=clock` a diagnostic build that counts clock ticks per attention phase
(-DKVRUN_PHASE_CLOCK, read by tools/attn_phases.py; one thread only).
`KVRUN_NATIVE_LIB=/path/to.so` loads that shared object instead of building one: two
commits' builds timed by the same tool in alternating processes.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ... import knobs
from .structs import check_layout, layout_source

# one shared object from every C source here: attention (decode_attention.c, with its integer
# q.K over KIVI keys in kdot_int.c), the flushes
# into the compressed tail (pack.c), the dense part of a decoder layer (decode_layer.c) with
# its GEMVs (gemv_quant.c + gemv_int.c, gemv_fp32.c) and the sliding ring's step
# (ring_attention.c), and the codebook codecs' tile reads for the attention (codebook_attention.c
# with AVX-512, codebook_portable.c without) and their flush (codebook_pack.c)
SRCS = [Path(__file__).with_name(n) for n in ("decode_attention.c", "kdot_int.c", "pack.c",
                                              "decode_layer.c", "gemv_quant.c", "gemv_int.c", "gemv_fp32.c",
                                              "ring_attention.c", "codebook_attention.c",
                                              "codebook_portable.c", "codebook_pack.c")]
# included by the sources above: the packed layouts attention and pack share, fp32 helpers,
# the window rows of the arena's attention, the asymmetric quantizer of the flushes and the
# ring, the GEMVs' interface, the integer q.K's, the integer ISA choice both share, the codec
# descriptor the attention reads, what the one-call decode step hands the attention, the
# codebook groups both codebook readers decode
HEADERS = [Path(__file__).with_name(n) for n in ("args.h", "codec_layout.h", "math_inline.h", "rows_inline.h",
                                                 "quant_inline.h", "gemv.h", "kdot_int.h", "int_dot.h",
                                                 "codec_desc.h", "step_io.h", "codebook_group.h",
                                                 # decode_attention.c's parts (one translation unit)
                                                 "attn_code_rows.h", "attn_tiles_int.h", "attn_fp_rows.h",
                                                 "attn_tiles_avx512.h", "attn_tiles_avx2.h",
                                                 "attn_tail_reads.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
         "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-std=gnu11"]

_lib = None
_err: str | None = None
_tried = False


def cache_dir() -> Path:
    return knobs.home() / "native"


def _compiler() -> str:
    return os.environ.get("CC", "gcc")


TMP_PREFIX = ".build-"          # a compile in progress; renamed to its final name when done
STALE_S = 3600                  # no compile takes an hour: such a temp was left by a kill


def _remove_stale_builds(d: Path) -> None:
    """Temps of compiles that a signal or a kill interrupted (the `finally` below does not
    run on SIGKILL, nor on SIGTERM in a library that installs no handler)."""
    import time
    for p in d.glob(TMP_PREFIX + "*"):                # the .so and its generated -layout.c
        try:
            if time.time() - p.stat().st_mtime > STALE_S:
                p.unlink()
        except OSError:                 # removed by a concurrent build meanwhile
            pass


def _build(extra: tuple = ()) -> Path:
    """Compile (once) and return the shared object's path. `extra` flags make a variant,
    e.g. ("-DKVRUN_NO_AVX512",): the portable tile path the tests also check."""
    cc = _compiler()
    layout = layout_source().encode()                          # structs.py's generated table
    src = b"".join(p.read_bytes() for p in SRCS + HEADERS) + layout   # a header edit rebuilds too
    flags = FLAGS + list(extra)
    ver = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(src + ver.encode() + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_dir() / f"decode_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(out.parent)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=".so", dir=out.parent)
    os.close(fd)
    gen = tmp[:-3] + "-layout.c"
    try:
        Path(gen).write_bytes(layout)
        r = subprocess.run([cc, *flags, "-I", str(Path(__file__).parent), *map(str, SRCS), gen,
                            "-o", tmp, "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            raise OSError(f"{cc} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
        os.replace(tmp, out)
    finally:
        for f in (tmp, gen):
            if os.path.exists(f):
                os.unlink(f)
    return out


def load():
    """The ctypes library, or None when it cannot be built here (see error())."""
    global _lib, _err, _tried
    if _tried:
        return _lib
    _tried = True
    mode = knobs.native()
    if mode == "0":
        _err = "disabled by KVRUN_NATIVE=0"
        return None
    # KVRUN_NATIVE=portable builds the variant machines without AVX-512 get, so the whole
    # suite can run on it from an AVX-512 machine (tolerances must hold on both)
    extra = {"portable": ("-DKVRUN_NO_AVX512",), "clock": ("-DKVRUN_PHASE_CLOCK",)}.get(mode, ())
    try:
        import torch                                    # noqa: F401  (loads torch's libgomp first)
        _lib = ctypes.CDLL(knobs.native_lib() or str(_build(extra)))
        _lib.kvrun_decode_attention.restype = ctypes.c_int
        bad = check_layout(_lib)                 # the ctypes mirrors against C's layout
        if bad:
            raise OSError(f"argument structs disagree: {bad}")
    except (OSError, subprocess.SubprocessError, FileNotFoundError,
            AttributeError) as e:               # AttributeError: a KVRUN_NATIVE_LIB without our symbols
        _err = str(e).splitlines()[0] if str(e) else type(e).__name__
        _lib = None
        if knobs.debug():
            print(f"kvrun: native kernels unavailable: {_err}", file=sys.stderr)
    return _lib


def error() -> str | None:
    load()
    return _err
