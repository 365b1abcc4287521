"""`megamoe demo`: the main job on CPU — a scaled-down DSV4-Pro-shaped layer over gloo ranks.

For every quant scheme x legal dispatch wire x combine wire it runs the EP layer and reports relL2
against the fp32 reference on dequantised weights, whether the bf16-wire result is bit-identical to
the single-process layer, and the wire bytes per token, then one verdict line. It checks correctness,
not speed: CPU times say nothing about the GPU kernels (``megamoe bench`` on a GPU does). The run is
cli/demo_run.py; this module holds the arguments only, so ``megamoe demo --help`` imports no torch.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (processes); must divide --experts")
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (a multiple of 32)")
    p.add_argument("--inter", type=int, default=256, help="expert intermediate size (a multiple of 32)")
    p.add_argument("--experts", type=int, default=32, help="routed experts (at least the top-k, 6)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the rows as JSON here")
    p.add_argument("--verbose", action="store_true", help="print every rank's startup line as it is logged")
    p.epilog = ("Knobs: MEGA_DISPATCH_WIRE / MEGA_COMBINE_WIRE keep only the rows on that wire; MEGA_DISPATCH is "
                "checked as on this CPU (gloo); the other MEGA_* knobs size or time GPU paths the demo does not "
                "run, and are refused.")


def run(args: argparse.Namespace) -> int:
    from .demo_run import run_demo

    return run_demo(args)
