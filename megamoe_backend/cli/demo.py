"""`megamoe demo`: the main job on CPU — a scaled-down DSV4-Pro-shaped layer over 2 gloo ranks.

For every quant scheme x legal dispatch wire x combine wire it runs the EP layer, and reports
relL2 against the fp32 reference on dequantised weights, whether the bf16-wire result is
bit-identical to the single-process layer, wire bytes per token, and the measured forward time.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from ..experts import ExpertMath, ExpertWeights
from ..formats import combine_wire, dispatch_wire
from ..knobs import Knobs
from ..layer import MegaMoELayer, fp32_reference_moe, rel_l2
from ..parallel import spawn_ranks
from ..plan import build_plan
from ..spec import preset
from ..workload import EPCase, Problem, ProblemConfig, make_problem, run_ep_cases

# relL2 gates vs the fp32 reference. bf16 experts with the fp8 combine wire: e4m3 keeps 3 mantissa
# bits, so each returned contribution carries ~2-3% error; 0.05 bounds that.
ACCURACY_GATES = {("bf16", "bf16"): 0.01, ("bf16", "fp8_blockwise_1x32"): 0.05, "a8w4": 0.10, "a4w4": 0.28}


def accuracy_gate(quant: str, combine: str) -> float:
    return ACCURACY_GATES.get((quant, combine), ACCURACY_GATES.get(quant, 0.0))


@dataclass(frozen=True)
class DemoRow:
    quant: str
    dispatch_wire: str
    combine_wire: str
    rel_l2: float
    gate: float
    bit_identical_to_local: bool | None
    dispatch_bytes_per_token: int
    combine_bytes_per_pair: int
    ms_per_forward: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (processes)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--iters", type=int, default=3, help="timed forwards per case (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the rows as JSON here")


def demo_cases(iters: int) -> list[EPCase]:
    cases = []
    for quant in ("bf16", "a8w4", "a4w4"):
        a = ExpertMath(quant).a_format
        for wire in ("bf16",) + ((a,) if a else ()):
            for comb in ("bf16", "fp8_blockwise_1x32"):
                cases.append(EPCase(quant, wire, comb, iters=iters + 1))
    return cases


def local_result(cfg: ProblemConfig, case: EPCase, problem: Problem, weights: ExpertWeights) -> torch.Tensor:
    """The same experts in one process (no EP), for the bit-identity check."""
    plan = build_plan(cfg.spec, Knobs(dispatch_wire=case.dispatch_wire, combine_wire=case.combine_wire), quant=case.quant)
    layer = MegaMoELayer(plan, weights)
    return layer(problem.x, problem.topk_ids, problem.topk_weights)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    spec = preset("dsv4-pro").scaled(
        name="dsv4-pro (scaled)", hidden_size=args.hidden, moe_intermediate_size=args.inter, n_routed_experts=args.experts
    )
    cfg = ProblemConfig(spec, args.tokens, args.ranks, seed=args.seed)
    problem = make_problem(cfg)
    console = Console()
    console.print(
        f"megamoe demo: {args.ranks} gloo ranks x {args.tokens} tokens, hidden={spec.hidden_size} "
        f"inter={spec.moe_intermediate_size} experts={spec.n_routed_experts} topk={spec.num_experts_per_tok} "
        f"swiglu_limit={spec.swiglu_limit} (DSV4-Pro shape, scaled down)"
    )
    cases = demo_cases(args.iters)
    rows: list[DemoRow] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("EP runs", total=len(cases))
        for quant in ("bf16", "a8w4", "a4w4"):
            group = [c for c in cases if c.quant == quant]
            per_rank = spawn_ranks(args.ranks, run_ep_cases, cfg, group)
            all_weights = problem.expert_weights(quant)
            w1, w2 = all_weights.dequantized()
            ref = fp32_reference_moe(problem.x, problem.topk_ids, problem.topk_weights, w1, w2, "interleaved", spec.swiglu_limit)
            for i, case in enumerate(group):
                out = torch.cat([r[i]["out"] for r in per_rank])
                identical = None
                if case.dispatch_wire == "bf16" and case.combine_wire == "bf16":
                    identical = bool(torch.equal(out, local_result(cfg, case, problem, all_weights)))
                rows.append(DemoRow(
                    quant=quant,
                    dispatch_wire=case.dispatch_wire,
                    combine_wire=case.combine_wire,
                    rel_l2=rel_l2(out.float(), ref),
                    gate=accuracy_gate(quant, case.combine_wire),
                    bit_identical_to_local=identical,
                    dispatch_bytes_per_token=dispatch_wire(case.dispatch_wire).row_bytes(spec.hidden_size),
                    combine_bytes_per_pair=combine_wire(case.combine_wire).row_bytes(spec.hidden_size),
                    ms_per_forward=1e3 * max(r[i]["seconds"] for r in per_rank),
                ))
                progress.advance(task)
    table = Table(title="MegaMoE EP demo (CPU, gloo): accuracy vs fp32 reference on dequantised weights")
    for col in ("quant", "dispatch", "combine", "relL2", "gate", "= local", "B/token", "B/pair", "ms"):
        table.add_column(col, no_wrap=True)
    failed = False
    for r in rows:
        ok = r.rel_l2 < r.gate and r.bit_identical_to_local is not False
        failed |= not ok
        table.add_row(
            r.quant, r.dispatch_wire, r.combine_wire.replace("blockwise_1x32", "b"), f"{r.rel_l2:.4f}", f"< {r.gate}",
            "-" if r.bit_identical_to_local is None else ("yes" if r.bit_identical_to_local else "NO"),
            str(r.dispatch_bytes_per_token), str(r.combine_bytes_per_pair), f"{r.ms_per_forward:.1f}",
            style=None if ok else "bold red",
        )
    console.print(table)
    console.print(
        "dispatch/combine: wires (fp8_b = fp8_blockwise_1x32). = local: bf16-wire result bit-identical to the "
        "single-process layer. B/token: dispatch bytes per token per destination; B/pair: combine bytes per "
        "(token, expert). ms: forward time of the slowest rank, best of --iters, torch reference experts on CPU."
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=2)
    return 1 if failed else 0
