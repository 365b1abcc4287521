"""`megamoe demo`'s run (arguments: cli/demo.py): check the knobs and the shape, run every case on
gloo ranks, print the table of relL2 / bit identity / wire bytes and one verdict line.

Why checks before the ranks start: a bad shape or knob found inside the rank processes prints each
rank's traceback (dozens of lines); found here it is one line naming the flag or knob.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass
from typing import Mapping

import torch

from ..experts import ExpertMath, ExpertWeights
from ..formats import combine_wire, dispatch_wire
from ..knobs import KNOB_NAMES, KnobError, Knobs
from ..layer import MegaMoELayer, fp32_reference_moe, rel_l2
from ..parallel import spawn_ranks
from ..plan import PlacementError, build_plan
from ..spec import MoESpec, preset
from ..workload import EPCase, Problem, ProblemConfig, make_problem, run_ep_cases
from .startup_summary import summarise_startup_lines

# relL2 gates vs the fp32 reference. bf16 experts with the fp8 combine wire: e4m3 keeps 3 mantissa
# bits, so each returned contribution carries ~2-3% error; 0.05 bounds that.
ACCURACY_GATES = {("bf16", "bf16"): 0.01, ("bf16", "fp8_blockwise_1x32"): 0.05, "a8w4": 0.10, "a4w4": 0.28}
QUANTS = ("bf16", "a8w4", "a4w4")
# the knobs the demo applies: the wires pick the rows, MEGA_DISPATCH is selected as on this CPU
APPLIED_KNOBS = ("MEGA_DISPATCH_WIRE", "MEGA_WIRE", "MEGA_COMBINE_WIRE", "MEGA_DISPATCH")


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

    @property
    def ok(self) -> bool:
        return self.rel_l2 < self.gate and self.bit_identical_to_local is not False


def demo_knobs(env: Mapping[str, str]) -> Knobs:
    """The MEGA_* knobs, validated (KnobError names a bad value); a knob the demo does not apply is refused."""
    knobs = Knobs.from_env(env)
    unused = [name for name in KNOB_NAMES if name not in APPLIED_KNOBS and (env.get(name) or "").strip()]
    if unused:
        raise KnobError(f"{unused[0]}={env[unused[0]]} is set, but megamoe demo does not apply it (torch reference "
                        f"experts on CPU over gloo, every scheme x wire): unset {' '.join(unused)} to run the demo")
    return knobs


def demo_cases(knobs: Knobs, env: Mapping[str, str]) -> list[EPCase]:
    """Every scheme x legal dispatch wire x combine wire; a wire set in the environment keeps its rows only."""
    combine_set = bool((env.get("MEGA_COMBINE_WIRE") or "").strip())
    cases = []
    for quant in QUANTS:
        a = ExpertMath(quant).a_format
        for wire in ("bf16",) + ((a,) if a else ()):
            for comb in ("bf16", "fp8_blockwise_1x32"):
                if (knobs.dispatch_wire_set and wire != knobs.dispatch_wire) or (combine_set and comb != knobs.combine_wire):
                    continue
                cases.append(EPCase(quant, wire, comb, transport=knobs.transport))
    return cases


def check_cases(spec: MoESpec, ranks: int, cases: list[EPCase]) -> None:
    """Plan every case for rank 0 of ``ranks`` as the ranks will (ValueError: the flag or knob at fault)."""
    if ranks < 1:
        raise ValueError(f"--ranks {ranks}: the demo needs at least 1 rank")
    for case in cases:
        knobs = Knobs(dispatch_wire=case.dispatch_wire, combine_wire=case.combine_wire, transport=case.transport)
        try:
            build_plan(spec, knobs, 0, ranks, device_type="cpu", quant=case.quant)
        except PlacementError as exc:
            raise PlacementError(f"--experts {spec.n_routed_experts} over --ranks {ranks}: {exc}") from exc


def local_result(cfg: ProblemConfig, case: EPCase, problem: Problem, weights: ExpertWeights) -> tuple[torch.Tensor, str]:
    """The same experts in one process (no EP), for the bit-identity check; and its startup line."""
    plan = build_plan(cfg.spec, Knobs(dispatch_wire=case.dispatch_wire, combine_wire=case.combine_wire), quant=case.quant)
    layer = MegaMoELayer(plan, weights)
    line = plan.startup_line(layer.transport_name, experts=getattr(layer.provider, "name", None))
    return layer(problem.x, problem.topk_ids, problem.topk_weights), line


def quiet_ep_cases(rank: int, world_size: int, cfg: ProblemConfig, cases: list[EPCase], verbose: bool) -> list[dict]:
    """``run_ep_cases`` on one rank, its layers' startup log lines held back unless ``verbose``
    (each result still carries its line, for the summary)."""
    if not verbose:
        logging.getLogger("megamoe").setLevel(logging.WARNING)
    return run_ep_cases(rank, world_size, cfg, cases)


def print_startup_summary(console, summary) -> None:
    """The layers' startup lines, one table row per distinct plan (fields all plans share: once, above)."""
    from rich import box
    from rich.table import Table

    console.print(
        f"layer plans: {len(summary.plans)} distinct over {summary.line_count} layers built (each logs one startup "
        "line; --verbose prints them); all with " + " ".join(f"{k}={v}" for k, v in summary.shared.items()),
        highlight=False,
    )
    table = Table(box=box.SIMPLE_HEAD)
    for col in ("ep_ranks",) + summary.columns:
        table.add_column(col, no_wrap=True)
    for ranks, values in summary.plans:
        table.add_row(ranks, *values)
    console.print(table)


def results_table(rows: list[DemoRow]):
    """The rows as a rich Table that fits 80 columns: short headers, no outer box."""
    from rich import box
    from rich.table import Table

    table = Table(title="EP demo (CPU, gloo): relL2 vs fp32 on dequantised weights", box=box.SIMPLE_HEAD)
    for col in ("quant", "disp", "comb", "relL2", "gate", "=local", "B/tok", "B/pair"):
        table.add_column(col, no_wrap=True, justify="left" if col in ("quant", "disp", "comb") else "right")
    for r in rows:
        table.add_row(
            r.quant, r.dispatch_wire, r.combine_wire.replace("_blockwise_1x32", "_b"), f"{r.rel_l2:.4f}", f"<{r.gate}",
            "-" if r.bit_identical_to_local is None else ("yes" if r.bit_identical_to_local else "NO"),
            str(r.dispatch_bytes_per_token), str(r.combine_bytes_per_pair),
            style=None if r.ok else "bold red",
        )
    return table


def verdict(rows: list[DemoRow]) -> str:
    """One line: every row within its gate and bit-identical where checked, or which rows are not."""
    bad = [f"{r.quant}/{r.dispatch_wire}/{r.combine_wire}" for r in rows if not r.ok]
    if not bad:
        checked = sum(r.bit_identical_to_local is not None for r in rows)
        same = f", the {checked} bf16-wire runs bit-identical to the single-process layer" if checked else ""
        return f"verdict: PASS: all {len(rows)} EP runs within their relL2 gate vs fp32{same}"
    return f"verdict: FAIL: {len(bad)} of {len(rows)} EP runs outside their gate or not bit-identical: {', '.join(bad)}"


def run_cases(args: argparse.Namespace, cfg: ProblemConfig, problem: Problem, cases: list[EPCase], progress, task,
              startup_lines: list[str]) -> list[DemoRow]:
    """Every case on ``args.ranks`` gloo ranks (one group of processes per scheme), as table rows."""
    spec, rows = cfg.spec, []
    for quant in QUANTS:
        group = [c for c in cases if c.quant == quant]
        if not group:
            continue
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
                quant=quant, dispatch_wire=case.dispatch_wire, combine_wire=case.combine_wire,
                rel_l2=rel_l2(out.float(), ref), gate=accuracy_gate(quant, case.combine_wire),
                bit_identical_to_local=identical,
                dispatch_bytes_per_token=dispatch_wire(case.dispatch_wire).row_bytes(spec.hidden_size),
                combine_bytes_per_pair=combine_wire(case.combine_wire).row_bytes(spec.hidden_size),
            ))
            progress.advance(task)
    return rows


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    try:
        knobs = demo_knobs(os.environ)
        cases = demo_cases(knobs, os.environ)
        spec = preset("dsv4-pro").scaled(name="dsv4-pro (scaled)", hidden_size=args.hidden,
                                         moe_intermediate_size=args.inter, n_routed_experts=args.experts)
        check_cases(spec, args.ranks, cases)
    except ValueError as exc:  # KnobError, PlacementError, PlatformError, a shape the plan refuses
        print(f"megamoe demo: error: {exc}")
        return 2
    cfg = ProblemConfig(spec, args.tokens, args.ranks, seed=args.seed)
    problem = make_problem(cfg)
    console = Console()
    console.print(
        f"megamoe demo: {args.ranks} gloo ranks x {args.tokens} tokens, hidden={spec.hidden_size} "
        f"inter={spec.moe_intermediate_size} experts={spec.n_routed_experts} topk={spec.num_experts_per_tok} "
        f"swiglu_limit={spec.swiglu_limit} (DSV4-Pro shape, scaled down)"
    )
    startup_lines: list[str] = []
    megamoe_log = logging.getLogger("megamoe")
    log_level = megamoe_log.level
    if not args.verbose:
        megamoe_log.setLevel(logging.WARNING)  # the single-process layers' lines: summarised below
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("EP runs", total=len(cases))
            rows = run_cases(args, cfg, problem, cases, progress, task, startup_lines)
    finally:
        megamoe_log.setLevel(log_level)
    if not args.verbose:
        print_startup_summary(console, summarise_startup_lines(startup_lines))
    console.print(results_table(rows))
    console.print(
        "disp / comb: dispatch / combine wire (fp8_b = fp8_blockwise_1x32). =local: the bf16-wire result is "
        "bit-identical to the single-process layer. B/tok: dispatch bytes per token per destination rank; "
        "B/pair: combine bytes per (token, expert). Correctness only: CPU times say nothing about the GPU "
        "kernels (megamoe bench, on a GPU)."
    )
    console.print(verdict(rows), highlight=False)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=2)
    return 0 if all(r.ok for r in rows) else 1
