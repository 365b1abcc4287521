"""`megamoe` command line: info | demo | bench."""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "info": ("megamoe_backend.cli.info", "print the resolved plan (spec, knobs, wire bytes, startup line)"),
    "demo": ("megamoe_backend.cli.demo", "run the EP layer on 2 gloo ranks (CPU) for every wire x quant"),
}
BENCH_TARGETS = {
    "experts": ("megamoe_backend.bench.bench_experts", "single-GPU expert kernels vs torch._grouped_mm and the floor"),
    "layer": ("megamoe_backend.bench.bench_layer", "the whole layer in a CUDA graph vs its experts, naive torch, the floor"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megamoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    bench = sub.add_parser("bench", help="benchmarks (JSON + table)")
    bench_sub = bench.add_subparsers(dest="target", required=True)
    for name, (module, help_text) in BENCH_TARGETS.items():
        p = bench_sub.add_parser(name, help=help_text)
        try:
            importlib.import_module(module).add_arguments(p)
        except ImportError as exc:  # keep `megamoe --help` working where the bench's deps are absent
            p.set_defaults(_import_error=str(exc))
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_import_error", None):
        print(f"megamoe {args.command}: cannot run here: {args._import_error}", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
