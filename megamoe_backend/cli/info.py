"""`megamoe info`: print the resolved plan for a model on the target host (cli/info_plan.py computes it).

This module imports no torch at module level, so ``megamoe info --help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="CONFIG.json", help="a Hugging Face config.json (or its folder)")
    src.add_argument("--preset", default=None, help="dsv4-pro | r1-mxfp4 | r1-fp8 (block-FP8 experts: plan with --device cpu) "
                                                         "(default dsv4-pro)")
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--ep-rank", type=int, default=0)
    p.add_argument("--redundant-experts", type=int, default=0, metavar="R",
                   help="EPLB redundant experts (vLLM num_redundant_experts, SGLang --ep-num-redundant-experts): "
                        "plan the engines' initial map, n_routed_experts + R physical experts")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "rocm"), default="auto",
                   help="device kind to plan for (auto: what this machine has); planning for a GPU this machine "
                        "lacks assumes that host's required software and says so")
    p.add_argument("--engine", default=None, metavar="ENGINE-VERSION",
                   help="read the checkpoint as this engine release's own quant method does (vllm-0.32 to "
                        "vllm-0.34, newer vLLM read as 0.34, sglang-0.5.23): vLLM 0.33+ runs DeepSeek V4 fp4 "
                        "experts A8W4 on the fp8 wire by default; without it, the checkpoint's own declaration")
    p.add_argument("--gfx-arch", default=None, metavar="ARCH",
                   help="with --device rocm: plan for this AMD GPU (gfx950, gfx1250) with the aiter / mori installed "
                        "here, as on that box (selection asks the installed aiter's plan builder)")
    p.add_argument("--gpu-memory-gb", type=float, default=None, metavar="GB",
                   help="compare the layer's memory with a GPU of this many GB (default: this machine's GPU, else an "
                        "H200's 141 GB)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    from ..knobs import KnobError
    from ..spec import ConfigError
    from .info_plan import info_dict, resolve

    try:
        r = resolve(args)
    except (KnobError, ConfigError, ValueError) as exc:
        print(f"megamoe info: error: {exc}")
        return 2
    info = info_dict(r)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print_table(r, info)
    for line in (*r.assumed, r.release_note, r.choice.override_line(), r.memory.warning()):
        if line:
            print(line)
    forecast, plan = r.forecast, r.plan
    if forecast is None:
        print(r.startup_line())
    else:  # auto is pending until the EP group settles it: the line of what it picks on one host (or on this one)
        print(f"MEGA_DISPATCH=auto: {forecast.describe()}; {forecast.depends_on}")
        picked = forecast.here or forecast.one_host
        where = "on this host" if forecast.here else "on one host with peer access"
        print(f"startup line when auto picks {picked} ({where}; {forecast.several_hosts}, eager, across hosts):")
        print(r.startup_line())
    return 0


def print_table(r, info: dict) -> None:
    """The plan as a rich table (``r``: cli/info_plan.py InfoPlan; ``info``: its JSON)."""
    from rich.console import Console
    from rich.table import Table

    from .info_plan import describe_forward

    spec, plan, wb = r.spec, r.plan, r.plan.wire_bytes()
    table = Table(title=f"MegaMoE plan: {spec.name or spec.model_type or 'model'}", show_header=False)
    for key in ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                "num_hidden_layers", "first_k_dense_replace", "n_group", "topk_group", "scoring_func", "topk_method",
                "routed_scaling_factor", "norm_topk_prob", "swiglu_limit"):
        table.add_row(key, str(getattr(spec, key)))
    table.add_row("quant", r.choice.describe())
    if r.release is not None:
        table.add_row("engine reading", f"{r.release}: {r.reading.source} -> {r.reading.scheme}" if r.reading else
                      f"{r.release}: names no activation format (the checkpoint's own scheme)")
    table.add_row("knobs", r.knobs_line())
    table.add_row("experts (EPLB)", f"{plan.placement.describe()} local/rank={plan.num_local_experts}")
    table.add_row("device / provider / transport", f"{r.device} / {plan.backends.provider} / {r.transport}")
    table.add_row("expert GEMMs", info["experts_gemm"])
    table.add_row("platform", "\n".join(r.facts.describe()))
    shown = plan.backends if r.forecast is None else dataclasses.replace(plan.backends, transport=r.transport)
    table.add_row("selection", shown.describe())
    table.add_row("why", "\n".join(info["selection_reasons"]))
    table.add_row("forward", describe_forward(r.forward))
    table.add_row("dispatch bytes / token / dest", f"{wb.dispatch_payload} + {wb.dispatch_scales} scales (+ {wb.dispatch_meta} routing meta)")
    table.add_row("combine bytes / (token, expert)", f"{wb.combine_payload} + {wb.combine_scales} scales")
    if r.forecast is not None:
        table.add_row("MEGA_DISPATCH=auto", f"{r.forecast.describe()}\n{r.forecast.depends_on}")
    table.add_row("memory per GPU", "\n".join(r.memory.lines()))
    if r.heap is not None:
        from ..experts.aiter.heap import describe_heap

        table.add_row("symmetric memory", describe_heap(r.heap))
    Console().print(table)
