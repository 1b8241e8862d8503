"""The native kernels build wherever a C compiler is present. Every native test skips when
they do not (a machine without gcc runs the torch path), so a compile error in a C source
would otherwise turn those tests into skips and pass unnoticed."""
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
