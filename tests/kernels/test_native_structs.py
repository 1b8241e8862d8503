"""The ctypes mirrors of the C argument structs (kvrun.kernels.native.structs) have C's
layout, and a mirror that drifts from args.h is named."""
import ctypes

from kvrun.kernels import native
from kvrun.kernels.native import structs
from test_native_build import needs_gcc


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



def test_layout_source_has_one_entry_per_size_and_field():
    """The generated table: sizeof each struct, then offsetof each field (a trailing `_`,
    which dodges a Python keyword, dropped from the C name)."""
    src = structs.layout_source()
    n = sum(1 + len(cls._fields_) for cls, _ in structs.MIRRORS)
    assert src.count("    (int64_t)") == n
    assert "(int64_t)sizeof(Codec)" in src and "offsetof(Args, " in src
    assert not [f for cls, _ in structs.MIRRORS for f, _ in cls._fields_
                if f.endswith("_") and f"{f})" in src]


def test_a_library_without_the_table_is_named():
    assert "no kvrun_layout table" in structs.check_layout(ctypes.CDLL(None))
