"""The package's import graph has no circles (issue 46): read with the standard library's ``ast``,
every ``import`` / ``from ... import`` between modules of megamoe_backend/, lazy ones (inside
functions) included, since a lazy import still ties the two modules into one unit.

The finder is checked on a planted circle first, so a finder that sees nothing cannot pass. Run
once (2026-12-04) on the tree of 2377c6c it found the two circles issue 46 names: bench_layer <->
bench_layer_emulated <-> bench_layer_ep and status <-> status_clear <-> watchdog.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megamoe_backend"


def module_files(root: Path) -> dict[str, Path]:
    base = root.parent
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (a package's __init__ is not an edge: it only re-exports)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                stem = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        found |= {t for t in targets if t in modules and t != name and modules[t].name != "__init__.py"}
    return found


def circles(root: Path) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each sorted, the list sorted."""
    modules = module_files(root)
    edges = {m: imports_of(m, p, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_finder_sees_a_planted_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import x\n")
    (pkg / "a.py").write_text("from .sub import b\nx = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import y\n")  # a lazy import counts
    (pkg / "c.py").write_text("import pkg.a\ny = 2\n")
    (pkg / "d.py").write_text("from . import a\n")  # an edge into the circle, not part of it
    assert circles(pkg) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_megamoe_backend_has_no_import_circle():
    assert len(module_files(PACKAGE)) > 50  # the whole package was read
    assert circles(PACKAGE) == []
