"""Which Python modules of an unpacked package a code path can import, read statically (no import runs).

Why: the FlashInfer 0.7.4 bundle for the device (flashinfer074_bundle.py) carries only what the SM90
MXFP4 MegaMoE path can import, and "can" has to be an over-approximation that is checked, not a guess:

- every ``import`` / ``from ... import`` at ANY depth (module level, inside functions, under
  ``try`` / ``if``) counts, so a lazy import inside a function that the path may call is kept;
- ``from pkg import name`` counts ``pkg`` and, when it exists, the submodule ``pkg.name``;
- a string literal that is exactly the name of an indexed module (``importlib.import_module("a.b")``,
  lazy ``__getattr__`` tables) counts, and so does a literal starting with ``.`` resolved against the
  module's package (``import_module(".x", __package__)``);
- importing a module imports its parent packages' ``__init__``.

A module is indexed under its dotted name from each root (a site directory), and a root may be given a
prefix: a vendored tree that its package puts on ``sys.path`` at run time (FlashInfer's kernel drops put
their ``src/`` there) is indexed with no prefix, as Python would then find it.

``prune_dirs`` turns the closure into the directories to drop: a directory holding no reachable module
anywhere below it (JIT sources, other architectures' kernel drops, unrelated packages) goes whole; a
directory with one stays with all its files.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path


def index_modules(root: Path, prefix: str = "") -> dict[str, Path]:
    """dotted module name -> file, for every ``.py`` under ``root`` (``pkg/__init__.py`` is ``pkg``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or not all(p.isidentifier() for p in parts):
            continue
        out[".".join(([prefix] if prefix else []) + parts)] = path
    return out


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _resolve_relative(package: str, level: int, module: str | None) -> str | None:
    parts = package.split(".") if package else []
    if level - 1 > len(parts):
        return None
    base = parts[:len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else [])) or None


def imports_of(name: str, path: Path, index: dict[str, Path]) -> set[str]:
    """Candidate module names ``name`` (at ``path``) may import, at any depth (module docstring)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:
        return set()
    package = _package_of(name, path)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(package, node.level, node.module) if node.level else node.module)
            if base is None:
                continue
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and 0 < len(node.value) < 200:
            text = node.value
            if text.startswith(".") and text.strip(".").replace(".", "").isidentifier():
                level = len(text) - len(text.lstrip("."))
                resolved = _resolve_relative(package, level, text.lstrip(".") or None)
                if resolved:
                    found.add(resolved)
            elif text in index:
                found.add(text)
    return {m for m in found if m in index}


def closure(entries: Iterable[str], index: dict[str, Path]) -> set[str]:
    """Every indexed module reachable from ``entries`` (each must be indexed), parents included."""
    todo = list(entries)
    missing = [e for e in todo if e not in index]
    if missing:
        raise KeyError(f"entry modules not found: {missing}")
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parent = name.rpartition(".")[0]
        while parent:
            if parent in index and parent not in seen:
                todo.append(parent)
            parent = parent.rpartition(".")[0]
        todo.extend(m for m in imports_of(name, index[name], index) if m not in seen)
    return seen


def prune_dirs(top: Path, keep_files: set[Path]) -> list[Path]:
    """Directories under ``top`` (``top`` itself never) that hold none of ``keep_files`` anywhere below:
    the outermost ones only (dropping one drops its subdirectories)."""
    keep_dirs = {parent for f in keep_files for parent in f.resolve().parents}
    out: list[Path] = []

    def walk(d: Path) -> None:
        for child in sorted(p for p in d.iterdir() if p.is_dir()):
            if child.resolve() in keep_dirs:
                walk(child)
            else:
                out.append(child)

    walk(top)
    return out
