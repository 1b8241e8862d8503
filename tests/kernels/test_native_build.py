"""The native kernels build wherever a C compiler is present. Every native test skips when
they do not (a machine without gcc runs the torch path), so a compile error in a C source
would otherwise turn those tests into skips and pass unnoticed."""
import ctypes.util
import os
import shutil

import pytest

from kvrun.kernels import native

needs_gcc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None
                               or os.environ.get("KVRUN_NATIVE") == "0",
                               reason="no C compiler here, or native kernels disabled")


@needs_gcc
def test_the_native_kernels_build():
    assert native.load() is not None, native.error()


@needs_gcc
def test_the_portable_variant_builds():
    """-DKVRUN_NO_AVX512 (KVRUN_NATIVE=portable): the paths of machines without AVX-512."""
    assert native._build(("-DKVRUN_NO_AVX512",)).exists()


@needs_gcc
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the phase clock reads the x86 TSC")
def test_the_clock_variant_counts_each_phase(monkeypatch):
    """-DKVRUN_PHASE_CLOCK (KVRUN_NATIVE=clock, tools/attn_phases.py): one attention call adds
    ticks to every phase it runs and counts one call; the default build has no clock."""
    from attention_cases import attention_case
    from kvrun.kernels.native import decode_attention as nda
    assert not hasattr(native.load(), "kvrun_phase_ticks")
    lib = ctypes.CDLL(str(native._build(("-DKVRUN_PHASE_CLOCK",))))
    lib.kvrun_decode_attention.restype = ctypes.c_int
    monkeypatch.setattr(nda, "load", lambda: lib)
    ticks = (ctypes.c_uint64 * 6).in_dll(lib, "kvrun_phase_ticks")
    calls = ctypes.c_uint64.in_dll(lib, "kvrun_phase_calls")
    q, kt, vt, kw, vw, kn, vn = attention_case("kivi-4", "kivi-4", 2, 2, 64, 256, 64, 1)
    before, n0 = list(ticks), calls.value
    out = nda.decode_attention(q, kt, vt, 256, kw, vw, kn, vn)
    assert out is not None and calls.value == n0 + 1
    # prepare, tail q.K, window q.K, softmax, p.V, output: each ran, each took time
    assert all(t > b for t, b in zip(ticks, before)), (list(ticks), before)


@pytest.mark.parametrize("lib", ["missing.so", ctypes.util.find_library("m")])
def test_a_named_library_that_cannot_load_is_reported(monkeypatch, tmp_path, lib):
    """KVRUN_NATIVE_LIB names the shared object to load instead of building one: a path that
    is not one, or a library without kvrun's symbols (libm), leaves the torch path, with the
    reason in error()."""
    if lib is None:
        pytest.skip("no libm found here")
    for name in ("_lib", "_err", "_tried"):
        monkeypatch.setattr(native, name, None if name != "_tried" else False)
    path = str(tmp_path / lib) if lib == "missing.so" else lib
    monkeypatch.setenv("KVRUN_NATIVE_LIB", path)
    assert native.load() is None
    assert lib in native.error()


@needs_gcc
def test_every_mirrored_struct_has_cs_layout():
    """The ctypes mirrors (kernels/native/structs.py) against the layout table the build
    generates from them and compiles against args.h: equal on the default and the portable
    build, so no argument is read from the wrong offset."""
    from kvrun.kernels.native.structs import MIRRORS, check_layout
    assert len(MIRRORS) == 9                     # Codec, Args, ..., Weight, Moe, ...
    assert check_layout(native.load()) is None
    assert check_layout(ctypes.CDLL(str(native._build(("-DKVRUN_NO_AVX512",))))) is None


@needs_gcc
def test_a_mirror_that_drifts_from_c_is_named(monkeypatch):
    """A field whose ctypes type no longer matches C (RingArgs.Hkv widened to int64), or a
    field added on the Python side only: check_layout names what differs."""
    import ctypes as c
    from kvrun.kernels.native import structs
    lib, original = native.load(), structs.MIRRORS
    fields = list(structs.RingArgs._fields_)

    class Wide(c.Structure):
        _fields_ = [("Hkv", c.c_int64)] + fields[1:]

    class Longer(c.Structure):
        _fields_ = fields + [("extra", c.c_void_p)]
    for cls, what in ((Wide, "RingArgs.Gq"), (Longer, "entries")):
        mirrors = tuple((cls if m is structs.RingArgs else m, n) for m, n in original)
        monkeypatch.setattr(structs, "MIRRORS", mirrors)
        assert what in (structs.check_layout(lib) or ""), what
