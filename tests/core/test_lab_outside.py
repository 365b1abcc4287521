"""The lab stays out of the product (issue 59, item 2): no module of megamoe_backend/ imports the benchmarks
(benchmarks/: the benches, their references, the one-process emulator), lazily or not, so an install without
them (a wheel) serves; ``megamoe bench`` names its modules as strings and says in one line when they are absent
(tests/core/test_cli.py). The finder is checked on a planted import first, so a finder that sees nothing cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megamoe_backend"
LAB = "benchmarks"


def lab_imports(root: Path) -> list[str]:
    """``file:line`` of every import of the lab below ``root`` (module level or inside a function)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(n == LAB or n.startswith(LAB + ".") for n in names):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_the_finder_sees_a_planted_lab_import(tmp_path):
    (tmp_path / "mod.py").write_text("def f():\n    from benchmarks.emulated_ep import EmulatedEP\n    return EmulatedEP\n")
    (tmp_path / "other.py").write_text("import benchmarks_elsewhere\nfrom .benchmarks import x\n")
    assert lab_imports(tmp_path) == ["mod.py:2"]


def test_the_package_imports_nothing_from_the_lab():
    assert lab_imports(PACKAGE) == []
