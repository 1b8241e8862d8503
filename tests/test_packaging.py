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
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "*.c" in cfg["package-data"]["kvrun.kernels.native"]
    assert "*.h" in cfg["package-data"]["kvrun.kernels.native"]     # math_inline.h
    assert (ROOT / "kernels" / "native" / "decode_attention.c").is_file()
