"""`megamoe demo`: the main job on CPU — a scaled-down DSV4-Pro-shaped layer over 2 gloo ranks.

For every quant scheme x legal dispatch wire x combine wire it runs the EP layer, and reports
relL2 against the fp32 reference on dequantised weights, whether the bf16-wire result is
bit-identical to the single-process layer, wire bytes per token, and the measured forward time.
The table fits 80 columns (also when piped); the runtimes' startup lines are folded into one line
per distinct plan unless ``--verbose`` asks for every rank's line.
"""

from __future__ import annotations

import argparse
import json
import logging
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
from .startup_summary import summarise_startup_lines

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

    @property
    def ok(self) -> bool:
        return self.rel_l2 < self.gate and self.bit_identical_to_local is not False


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (processes)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--iters", type=int, default=3, help="timed forwards per case (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the rows as JSON here")
    p.add_argument("--verbose", action="store_true", help="print every rank's startup line as it is logged")


def demo_cases(iters: int) -> list[EPCase]:
    cases = []
    for quant in ("bf16", "a8w4", "a4w4"):
        a = ExpertMath(quant).a_format
        for wire in ("bf16",) + ((a,) if a else ()):
            for comb in ("bf16", "fp8_blockwise_1x32"):
                cases.append(EPCase(quant, wire, comb, iters=iters + 1))
    return cases


def local_result(cfg: ProblemConfig, case: EPCase, problem: Problem, weights: ExpertWeights) -> tuple[torch.Tensor, str]:
    """The same experts in one process (no EP), for the bit-identity check; and its startup line."""
    plan = build_plan(cfg.spec, Knobs(dispatch_wire=case.dispatch_wire, combine_wire=case.combine_wire), quant=case.quant)
    layer = MegaMoELayer(plan, weights)
    return layer(problem.x, problem.topk_ids, problem.topk_weights), plan.startup_line(layer.transport_name)


def quiet_ep_cases(rank: int, world_size: int, cfg: ProblemConfig, cases: list[EPCase], verbose: bool) -> list[dict]:
    """``run_ep_cases`` on one rank, its runtimes' startup log lines held back unless ``verbose``
    (each result still carries its line, for the summary)."""
    if not verbose:
        logging.getLogger("megamoe").setLevel(logging.WARNING)
    return run_ep_cases(rank, world_size, cfg, cases)


def print_startup_summary(console, summary) -> None:
    """The runtimes' startup lines, one table row per distinct plan (fields all plans share: once, above)."""
    from rich import box
    from rich.table import Table

    console.print(
        f"startup: {summary.runtimes} runtimes, {len(summary.plans)} distinct plans (--verbose: every rank's line); "
        "all with " + " ".join(f"{k}={v}" for k, v in summary.shared.items()), highlight=False,
    )
    table = Table(box=box.SIMPLE_HEAD)
    for col in ("ep_ranks",) + summary.columns:
        table.add_column(col, no_wrap=True)
    for ranks, values in summary.plans:
        table.add_row(ranks, *values)
    console.print(table)


def results_table(rows: list["DemoRow"]):
    """The rows as a rich Table that fits 80 columns: short headers, no outer box."""
    from rich import box
    from rich.table import Table

    table = Table(title="EP demo (CPU, gloo): relL2 vs fp32 on dequantised weights", box=box.SIMPLE_HEAD)
    for col in ("quant", "disp", "comb", "relL2", "gate", "=local", "B/tok", "B/pair", "ms"):
        table.add_column(col, no_wrap=True, justify="left" if col in ("quant", "disp", "comb") else "right")
    for r in rows:
        table.add_row(
            r.quant, r.dispatch_wire, r.combine_wire.replace("_blockwise_1x32", "_b"), f"{r.rel_l2:.4f}", f"<{r.gate}",
            "-" if r.bit_identical_to_local is None else ("yes" if r.bit_identical_to_local else "NO"),
            str(r.dispatch_bytes_per_token), str(r.combine_bytes_per_pair), f"{r.ms_per_forward:.0f}",
            style=None if r.ok else "bold red",
        )
    return table


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

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
    startup_lines: list[str] = []
    megamoe_log = logging.getLogger("megamoe")
    log_level = megamoe_log.level
    if not args.verbose:
        megamoe_log.setLevel(logging.WARNING)  # the single-process runtimes' lines: summarised below
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("EP runs", total=len(cases))
            for quant in ("bf16", "a8w4", "a4w4"):
                group = [c for c in cases if c.quant == quant]
                per_rank = spawn_ranks(args.ranks, quiet_ep_cases, cfg, group, args.verbose)
                all_weights = problem.expert_weights(quant)
                w1, w2 = all_weights.dequantized()
                ref = fp32_reference_moe(problem.x, problem.topk_ids, problem.topk_weights, w1, w2, "interleaved", spec.swiglu_limit)
                for i, case in enumerate(group):
                    out = torch.cat([r[i]["out"] for r in per_rank])
                    startup_lines += [r[i]["startup_line"] for r in per_rank]
                    identical = None
                    if case.dispatch_wire == "bf16" and case.combine_wire == "bf16":
                        local, line = local_result(cfg, case, problem, all_weights)
                        identical = bool(torch.equal(out, local))
                        startup_lines.append(line)
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
    finally:
        megamoe_log.setLevel(log_level)
    if not args.verbose:
        print_startup_summary(console, summarise_startup_lines(startup_lines))
    console.print(results_table(rows))
    console.print(
        "disp / comb: dispatch / combine wire (fp8_b = fp8_blockwise_1x32). =local: the bf16-wire result is "
        "bit-identical to the single-process layer. B/tok: dispatch bytes per token per destination rank; "
        "B/pair: combine bytes per (token, expert). ms: forward time of the slowest rank, best of --iters, "
        "torch reference experts on CPU."
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=2)
    return 0 if all(r.ok for r in rows) else 1
