"""The package's layers import downward only, and no module imports itself round a circle;
tests/ mirrors the package, so each module's tests are found by its name.

The allowed order is declared here, once (docs/architecture.md explains it): a module may
import from its own layer and the layers before it, never after. Function-level imports count
like module-level ones: an import moved into a function to dodge a circle is still a circle.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"runtime": "kvrun", "kernels": "kvrun.kernels", "convert": "kvrun.convert"}

# lowest first; a module's layer is the first prefix that matches its name
LAYERS = [
    ("knobs", ("kvrun.knobs",)),                # the KVRUN_* settings, read by every layer
    ("kernels", ("kvrun.kernels",)),
    ("base", ("kvrun.errors", "kvrun.files", "kvrun.threads", "kvrun.progress", "kvrun.machine")),
    ("kv", ("kvrun.kv",)),
    ("model", ("kvrun.model",)),
    ("convert", ("kvrun.convert",)),
    ("engine", ("kvrun.engine",)),
    ("eval", ("kvrun.eval",)),
    # the cluster (Ray Serve) runs the CLI's HTTP app in replicas, and `kvrun serve --ray`
    # hands over to it: one layer
    ("cli", ("kvrun.cli", "kvrun.cluster")),
    ("api", ("kvrun",)),                        # kvrun/__init__.py: the public re-exports
]


def layer_of(mod: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{mod} is in no layer: add it to LAYERS")


def modules() -> dict[str, Path]:
    found = {}
    for folder, pkg in FOLDERS.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([pkg, *parts])] = f
    return found


def imports(mod: str, path: Path, known: dict) -> list[tuple[str, int]]:
    """(imported kvrun module, line) of every import in the file, resolved to a module."""
    is_pkg = path.name == "__init__.py"
    pkg = mod if is_pkg else mod.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            # `from pkg import module` names the module itself
            names = [f"{src}.{a.name}" if f"{src}.{a.name}" in known else src for a in node.names]
        else:
            continue
        for n in names:
            if n == "kvrun" or n.startswith("kvrun."):
                while n not in known and "." in n:
                    n = n.rsplit(".", 1)[0]
                out.append((n, node.lineno))
    return out


def graph():
    known = modules()
    return known, {m: imports(m, p, known) for m, p in known.items()}


def test_every_import_runs_down_the_layers():
    known, edges = graph()
    up = []
    for m, deps in edges.items():
        for d, line in deps:
            if d != m and layer_of(d) > layer_of(m) and not (m == "kvrun" or d.startswith(m + ".")):
                up.append(f"{known[m].relative_to(ROOT)}:{line} ({LAYERS[layer_of(m)][0]}) imports "
                          f"{d} ({LAYERS[layer_of(d)][0]})")
    assert not up, "imports up the layers:\n" + "\n".join(sorted(up))


def test_no_import_circles():
    known, edges = graph()
    adj = {m: sorted({d for d, _ in deps if d != m and not m.startswith(d + ".")})
           for m, deps in edges.items()}
    # a package's __init__ re-exporting its modules is not a circle with them
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in adj[m]:
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2
    for m in sorted(adj):
        if m not in state:
            visit(m)
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_the_layer_table_covers_every_module():
    for m in modules():
        layer_of(m)


# attributes of other libraries that are private by name only (torch's aten ops, CPython's
# frame table), and super()'s own: not a reach into another kvrun module
FOREIGN_PRIVATE = ("torch.ops.aten.", "sys.", "super().")


def _owned(tree: ast.AST) -> set[str]:
    """The _names a module defines: its functions and methods, and attributes it assigns
    on `self` / `cls` (or class bodies)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name.startswith("_"):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and n.attr.startswith("_"):
            out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id.startswith("_"):
            out.add(n.id)
    return out


def test_no_module_reaches_into_another_ones_private_names():
    """`obj._name` outside `self` / `cls` only where the module itself defines `_name` (its
    own classes' internals); a private of another module is a contract nobody wrote down:
    give its owner a public name instead."""
    reaches = []
    for mod, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        own = _owned(tree)
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            text = ast.unparse(n)
            if n.attr in own or text.startswith(FOREIGN_PRIVATE):
                continue
            reaches.append(f"{path.relative_to(ROOT)}:{n.lineno} {text}")
    assert not reaches, "private names reached across modules:\n" + "\n".join(reaches)


def _test_folder(rel: Path) -> Path:
    """Where a module's tests live: tests/<sub>/ for runtime/<sub>/, tests/ for runtime/'s
    own modules, tests/kernels/ for all of kernels/ (flat), tests/convert/ for convert/."""
    if rel.parts[0] == "runtime":
        return ROOT / "tests" / (rel.parts[1] if len(rel.parts) > 2 else "")
    return ROOT / "tests" / rel.parts[0]


def _imported(path: Path) -> set[str]:
    out = set()
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            out |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    return out


def test_every_module_has_a_test_file_named_after_it():
    """Module `<folder>/<name>.py` has, in its test folder, a `test_<name>.py` (or
    `test_<name>_<aspect>.py`, or with its folder's name first: `test_native_<name>.py`)
    that imports it. The package's __init__ files and the shipped profiles are not modules
    of their own."""
    missing = []
    for mod, path in modules().items():
        rel = path.relative_to(ROOT)
        if path.name == "__init__.py" or "profiles" in rel.parts:
            continue
        heads = (f"test_{path.stem}", f"test_{path.parent.name}_{path.stem}")
        found = [t for t in _test_folder(rel).glob("test_*.py")
                 if any(t.stem == h or t.stem.startswith(h + "_") for h in heads)
                 and mod in _imported(t)]
        if not found:
            missing.append(f"{rel}: no {_test_folder(rel).relative_to(ROOT)}/test_{path.stem}.py importing {mod}")
    assert not missing, "modules without a test named after them:\n" + "\n".join(missing)


def test_test_file_names_are_unique():
    """conftest.py puts every tests/ folder on sys.path (tests borrow helpers from each other
    by module name), so two test files of one name would shadow each other."""
    names = [p.name for p in (ROOT / "tests").rglob("*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_every_test_file_the_tree_names_exists():
    """A doc, docstring or comment that sends the reader to a tests/…/test_<name>.py names a file
    that exists (the dated archive of measurements keeps its history as it was)."""
    have = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    stale = []
    for top in ("runtime", "kernels", "convert", "tools", "docs", "tests"):
        for f in sorted((ROOT / top).rglob("*")):
            if f.suffix not in (".py", ".md", ".c", ".h") or f.name == "measurements-archive.md":
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                stale += [f"{f.relative_to(ROOT)}:{i} {m}" for m in re.findall(r"\btest_[a-z0-9_]+\.py\b", line)
                          if m not in have]
    readme = (ROOT / "README.md").read_text()
    stale += [f"README.md {m}" for m in re.findall(r"\btest_[a-z0-9_]+\.py\b", readme) if m not in have]
    assert not stale, "test files named but missing:\n" + "\n".join(stale)
