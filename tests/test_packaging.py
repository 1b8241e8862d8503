"""A regular (non-editable) install ships every package and the native kernel's C source:
an editable install hides a package missing from pyproject's list (found when
kernels/native was added: a wheel would have lacked it and `import kvrun` would fail)."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_dir_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {d: name for name, d in cfg["package-dir"].items()}
    listed = set(cfg["packages"])
    for top, name in dirs.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            pkg = ".".join([name, *rel.parts]) if rel.parts else name
            assert pkg in listed, f"{pkg} ({init.parent}) is not in pyproject's packages"


def test_native_source_is_package_data():
    """Every source and header the build compiles (and hashes) ships: the package-data
    globs match them all and they live in kernels/native."""
    from fnmatch import fnmatch
    from kvrun.kernels import native
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = cfg["package-data"]["kvrun.kernels.native"]
    assert "*.c" in globs and "*.h" in globs
    names = {p.name for p in native.SRCS + native.HEADERS}
    assert {"decode_attention.c", "pack.c", "codec_layout.h", "math_inline.h"} <= names
    for p in native.SRCS + native.HEADERS:
        assert (ROOT / "kernels" / "native" / p.name).is_file(), p.name
        assert any(fnmatch(p.name, g) for g in globs), p.name
