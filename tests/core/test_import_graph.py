"""The package's import graph has no circles (issue 46), neither between modules nor between its
subpackages (issue 59): read with the standard library's ``ast``, every ``import`` / ``from ...
import`` of megamoe_backend/, lazy ones (inside functions) included, since a lazy import still ties
the two into one unit.

Why subpackages too: each subpackage is a layer (spec, experts, transport, plan, layer, ...), and a
circle between layers (experts -> transport -> plan -> experts through function-level imports, issue
59) leaves no order to read, test or move them in, even when no two modules import each other.

The finders are checked on planted circles first, so a finder that sees nothing cannot pass. Run
once (2026-12-04) on the tree of 2377c6c the module finder found the two circles issue 46 names:
bench_layer <-> bench_layer_emulated <-> bench_layer_ep and status <-> status_clear <-> watchdog. Run
on the tree of 64d6ae2 the subpackage finder found the one issue 59 names: experts, plan, spec, transport.
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


def imports_of(name: str, path: Path, modules: dict[str, Path], inits: bool = False) -> set[str]:
    """The package modules ``name`` imports (a package's __init__ is not an edge between modules: it
    only re-exports; ``inits``: it is one, for the subpackage graph, where importing ``..plan`` is
    importing the plan subpackage)."""
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
        found |= {t for t in targets if t in modules and t != name and (inits or modules[t].name != "__init__.py")}
    return found


def circles(root: Path) -> list[list[str]]:
    """Every circle of modules: each strongly connected set of two or more, sorted, the list sorted."""
    modules = module_files(root)
    return strongly_connected({m: imports_of(m, p, modules) for m, p in modules.items()})


def subpackage_of(module: str) -> str | None:
    """``pkg.plan.capture`` -> ``pkg.plan``; the root package itself (``pkg``) is in none."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else None


def subpackage_circles(root: Path) -> list[list[str]]:
    """Every circle of subpackages: module imports, lazy ones and ``__init__`` ones included, folded
    onto the first-level subpackage of each side; an import within one subpackage is no edge."""
    modules = module_files(root)
    edges: dict[str, set[str]] = {}
    for m, p in modules.items():
        source = subpackage_of(m)
        if source is None:
            continue
        targets = {subpackage_of(t) for t in imports_of(m, p, modules, inits=True)}
        edges.setdefault(source, set()).update(t for t in targets if t is not None and t != source)
    for targets in list(edges.values()):
        for t in targets:
            edges.setdefault(t, set())
    return strongly_connected(edges)


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more nodes of ``edges`` (Tarjan), each sorted, the list sorted."""
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


def test_the_subpackage_finder_sees_a_planted_circle_through_lazy_and_init_imports(tmp_path):
    pkg = tmp_path / "pkg"
    for sub in ("experts", "transport", "plan", "layer"):
        (pkg / sub).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "experts" / "__init__.py").write_text("")
    (pkg / "experts" / "runtime.py").write_text("def f():\n    from ..transport.mori import g\n")  # lazy
    (pkg / "transport" / "__init__.py").write_text("")
    (pkg / "transport" / "mori.py").write_text("from ..plan import LayerPlan\n")  # through plan's __init__
    (pkg / "plan" / "__init__.py").write_text("from .layer_plan import LayerPlan\n")
    (pkg / "plan" / "layer_plan.py").write_text("from ..experts import base\nLayerPlan = 1\n")
    (pkg / "experts" / "base.py").write_text("")
    (pkg / "layer" / "__init__.py").write_text("from ..plan import LayerPlan\n")  # into the circle, not in it
    assert circles(pkg) == []  # no two modules import each other...
    assert subpackage_circles(pkg) == [["pkg.experts", "pkg.plan", "pkg.transport"]]  # ...the subpackages do


def test_megamoe_backend_has_no_import_circle():
    assert len(module_files(PACKAGE)) > 50  # the whole package was read
    assert circles(PACKAGE) == []


def test_megamoe_backend_subpackages_have_no_import_circle():
    assert {"megamoe_backend.plan", "megamoe_backend.experts"} <= {subpackage_of(m) for m in module_files(PACKAGE)}
    assert subpackage_circles(PACKAGE) == []
