"""Re-derive the floors of a saved `bench experts` / `bench layer` JSON with benchmarks/floor.py (no GPU).

Why: the runs committed before issue 35 divided the FLOPs of every scheme by the bf16 MMA peak,
while A8W4 / A4W4 run FP8 MMA on Hopper; their times stay valid, only the floor and "x floor" were
against the wrong ceiling. This recomputes both from what each case recorded (experts hit, pairs,
shape) with the H200 datasheet ceilings: those runs measured no FP8 GEMM, so the datasheet FP8 peak
is the only one there is. First it recomputes each stored floor with the bf16 peak and checks it
matches (so the inputs are the ones the run used), then prints the new floor beside it.

    PYTHONPATH=. python3 benchmarks/research/refloor.py benchmarks/results/h200_experts.json
    PYTHONPATH=. python3 benchmarks/research/refloor.py benchmarks/results/h200_layer.json
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.bench_experts import SCHEMES
from benchmarks.floor import H200_SXM, expert_floor
from megamoe_backend.experts import ExpertMath

BF16_ONLY = {"bf16": H200_SXM.mma_flops_per_s["bf16"], "fp8": H200_SXM.mma_flops_per_s["bf16"]}  # the old floors' peak


def case_inputs(case: dict, layer: bool, topk: int) -> dict:
    """expert_floor's shape arguments (less hidden / intermediate) for one saved case."""
    if layer:  # bench layer: MXFP4 weights, the scheme's MX activations
        return dict(experts_hit=case["active_experts"], pairs=case["tokens"] * topk, weight_fmt="mxfp4",
                    a_fmt=ExpertMath(case["scheme"]).a_format)
    quant, wfmt = SCHEMES[case["scheme"]]
    return dict(experts_hit=case["active_experts"], pairs=case["pairs"], weight_fmt=wfmt,
                a_fmt=ExpertMath(quant).a_format)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", help="a bench experts / bench layer JSON")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        saved = json.load(f)
    layer = "cases" in saved
    shape = saved["meta"]["shape"]
    print("| E | T | scheme | provider / combine | µs | old floor (bf16) | floor | x floor | x floor isolated |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in saved["cases"] if layer else saved["results"]:
        if c.get("error"):
            continue
        kw = dict(**case_inputs(c, layer, shape["topk"]), hidden=shape["hidden"], intermediate=shape["intermediate"],
                  hbm_bytes_per_s=H200_SXM.hbm_bytes_per_s)
        old = expert_floor(**kw, mma_flops_per_s=BF16_ONLY)
        if abs(old.us - c["floor_us"]) > 1e-6 * c["floor_us"]:
            print(f"stored floor {c['floor_us']} != {old.us} recomputed with the bf16 peak: not this model's inputs",
                  file=sys.stderr)
            return 1
        new = expert_floor(**kw, mma_flops_per_s=H200_SXM.mma_flops_per_s)
        us = c["experts_us"] if layer else c["us"]
        iso = "" if layer else f"{c['us_isolated'] / new.us:.2f}"
        who = c["combine_wire"] if layer else c["provider"]
        bound = "HBM" if new.bound == "hbm" else new.mma.upper()
        print(f"| {c['experts']} | {c['tokens']} | {c['scheme']} | {who} | {us:.0f} | {old.us:.0f} "
              f"| {new.us:.0f} ({bound}) | {us / new.us:.2f} | {iso} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
