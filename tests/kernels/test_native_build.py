"""The native kernels build wherever a C compiler is present. Every native test skips when
they do not (a machine without gcc runs the torch path), so a compile error in a C source
would otherwise turn those tests into skips and pass unnoticed. A build is cached per
flags and written atomically (a killed build's temp is swept later). The structs' layout
check is tested in test_native_structs.py."""
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
def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRUN_HOME", str(tmp_path))
    a = native._build()
    mtime = a.stat().st_mtime_ns
    assert native._build() == a and a.stat().st_mtime_ns == mtime   # built once
    assert [p.name for p in (tmp_path / "native").iterdir()] == [a.name]  # no temp left


@needs_gcc
def test_a_killed_builds_temp_is_removed_later(tmp_path, monkeypatch):
    """SIGKILL (or SIGTERM in a program with no handler) skips the build's `finally`: the
    next build removes a temp older than any compile, and leaves a fresh one (a concurrent
    build's) alone."""
    import os
    import time
    monkeypatch.setenv("KVRUN_HOME", str(tmp_path))
    d = tmp_path / "native"
    d.mkdir()
    old, fresh = d / (native.TMP_PREFIX + "killed.so"), d / (native.TMP_PREFIX + "running.so")
    old.write_bytes(b"half")
    fresh.write_bytes(b"half")
    t = time.time() - native.STALE_S - 60
    os.utime(old, (t, t))
    a = native._build()
    assert sorted(p.name for p in d.iterdir()) == sorted([a.name, fresh.name])

