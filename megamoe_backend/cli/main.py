"""`megamoe` command line: info | demo | bench.

``bench`` is a thin entry: the benchmarks are not part of the installed package but the ``benchmarks``
package of a source checkout (found beside this package); without one it says so in one line.

Why the parser is built lazily: importing a command's module can import torch (seconds). ``megamoe
--help`` imports none of them, and ``megamoe X ...`` imports X's module only (``info`` and ``demo`` keep
their torch imports inside ``run``, so their ``--help`` is fast too).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

SUBCOMMANDS = {
    "info": ("megamoe_backend.cli.info", "print the resolved plan (spec, knobs, wire bytes, startup line)"),
    "demo": ("megamoe_backend.cli.demo", "run the EP layer on 2 gloo ranks (CPU) for every wire x quant"),
}
BENCH_TARGETS = {
    "experts": ("benchmarks.bench_experts", "single-GPU expert kernels vs torch._grouped_mm and the floor"),
    "layer": ("benchmarks.bench_layer", "the whole layer in a CUDA graph vs its experts, naive torch, the floor"),
}
# what `megamoe bench` needs that a CPU-only install lacks; checked before its module is imported
BENCH_NEEDS = "triton (pip install 'megamoe-backend[triton]') and a CUDA GPU"
# the source checkout this package would sit in (an editable install); a wheel install has no benchmarks/ there
CHECKOUT = Path(__file__).resolve().parents[2]
BENCH_ABSENT = ("the benchmarks are not installed with the package: run it from a source checkout "
                "(git clone, pip install -e .), whose benchmarks/ it imports")


def _benchmarks_on_path() -> bool:
    """Whether the checkout's ``benchmarks`` package exists; if so its checkout goes first on sys.path, so
    that package (not another of the same name) is the one imported."""
    if not (CHECKOUT / "benchmarks" / "__init__.py").is_file():
        return False
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    return True


def _chosen(argv: list[str] | None, names) -> set[str] | None:
    """The names in ``names`` that ``argv``'s first word picks; None: build every one (``argv`` None)."""
    if argv is None:
        return None
    words = [w for w in argv if not w.startswith("-")]
    return {words[0]} & set(names) if words else set()


def _bench_problem(module: str) -> str | None:
    """Why ``megamoe bench`` cannot run here (one line), or None."""
    from importlib.util import find_spec

    if not _benchmarks_on_path():
        return BENCH_ABSENT
    if find_spec("triton") is None:
        return f"needs {BENCH_NEEDS}; triton is not importable here"
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"cannot run here: {exc}"
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv`` only the command it names gets its arguments (its module imported)."""
    parser = argparse.ArgumentParser(prog="megamoe", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = _chosen(argv, [*SUBCOMMANDS, "bench"])
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if chosen is None or name in chosen:
            importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    bench = sub.add_parser("bench", help=f"benchmarks (JSON + table; needs {BENCH_NEEDS})")
    if chosen is not None and "bench" not in chosen:
        return parser
    bench_sub = bench.add_subparsers(dest="target", required=True)
    targets = _chosen(argv[1:] if argv else argv, BENCH_TARGETS)
    for name, (module, help_text) in BENCH_TARGETS.items():
        p = bench_sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        if targets is not None and name not in targets:
            continue
        problem = _bench_problem(module)
        if problem:  # `megamoe bench X --help` still answers (saying so); running it says what is missing
            p.set_defaults(_problem=problem)
            p.description = f"{help_text}: {problem}"
        else:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)  # a bench that cannot run here has no arguments to check
    if unknown and not getattr(args, "_problem", None):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "_problem", None):
        print(f"megamoe bench {args.target}: {args._problem}", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
