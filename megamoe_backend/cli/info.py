"""`megamoe info`: print the resolved plan for a model and the current environment."""

from __future__ import annotations

import argparse
import json

from ..experts.cuda.gemms import describe_choice
from ..knobs import KnobError, Knobs
from ..plan import ExpertPlacement, build_plan, facts_for, initial_redundant_map
from ..spec import ConfigError, MoESpec, describe_scheme, expert_quant_scheme, preset


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="CONFIG.json", help="a Hugging Face config.json (or its folder)")
    src.add_argument("--preset", default=None, help="dsv4-pro | r1-mxfp4 (default dsv4-pro)")
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--ep-rank", type=int, default=0)
    p.add_argument("--redundant-experts", type=int, default=0, metavar="R",
                   help="EPLB redundant experts (vLLM num_redundant_experts, SGLang --ep-num-redundant-experts): "
                        "plan the engines' initial map, n_routed_experts + R physical experts")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "rocm"), default="auto",
                   help="device kind to plan for (auto: what this machine has)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def detect_device_type() -> str:
    import torch

    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return "cpu"


def load_spec(model: str | None, preset_name: str | None) -> MoESpec:
    if model:
        from pathlib import Path

        path = Path(model)
        return MoESpec.from_config(path / "config.json" if path.is_dir() else path)
    return preset(preset_name or "dsv4-pro")


def run(args: argparse.Namespace) -> int:
    try:
        declared = load_spec(args.model, args.preset)
        knobs = Knobs.from_env()
        # What the engines would run: the checkpoint's scheme under AITER_FORCE_A8W4 (the plugins call the same function).
        spec = declared.scaled(quant=expert_quant_scheme(declared.quant, knobs.aiter_force_a8w4, "config.json"))
        device = detect_device_type() if args.device == "auto" else args.device
        placement = None
        if args.redundant_experts:
            p2l = initial_redundant_map(spec.n_routed_experts, args.redundant_experts)
            placement = ExpertPlacement.contiguous(p2l, args.ep_size, spec.n_routed_experts,
                                                   map_name=f"--redundant-experts {args.redundant_experts} map")
        plan = build_plan(spec, knobs, args.ep_rank, args.ep_size, placement=placement, device_type=device)
        platform = facts_for(device).describe()
    except (KnobError, ConfigError, ValueError) as exc:
        print(f"megamoe info: error: {exc}")
        return 2
    wb = plan.wire_bytes()
    info = {
        "spec": spec.to_dict(),
        "declared_quant": declared.quant,
        "knobs": knobs.to_dict(),
        "device": device,
        "platform": platform,
        "experts_provider": plan.backends.provider,
        "experts_gemm": describe_choice(knobs.experts_gemm, plan.backends.provider, device),
        "transport": plan.backends.transport,
        "selection_reasons": list(plan.backends.reasons),
        "local_experts": plan.num_local_experts,
        "experts": {
            "physical": plan.placement.num_physical, "logical": plan.placement.num_logical,
            "redundant_per_rank": list(plan.placement.redundant_per_rank()),
        },
        "dispatch_bytes_per_token_per_destination": {
            "payload": wb.dispatch_payload, "scales": wb.dispatch_scales, "row": wb.dispatch_row,
            "routing_meta": wb.dispatch_meta,
        },
        "combine_bytes_per_token_expert_pair": {"payload": wb.combine_payload, "scales": wb.combine_scales, "row": wb.combine_row},
        "startup_line": plan.startup_line(),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"MegaMoE plan: {spec.name or spec.model_type or 'model'}", show_header=False)
    for key in ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                "num_hidden_layers", "first_k_dense_replace", "n_group", "topk_group", "scoring_func", "topk_method",
                "routed_scaling_factor", "norm_topk_prob", "swiglu_limit"):
        table.add_row(key, str(getattr(spec, key)))
    table.add_row("quant", describe_scheme(declared.quant, spec.quant))
    table.add_row("knobs", ", ".join(f"{k}={v}" for k, v in knobs.to_dict().items()))
    table.add_row("experts (EPLB)", f"{plan.placement.describe()} local/rank={plan.num_local_experts}")
    table.add_row("device / provider / transport", f"{device} / {plan.backends.provider} / {plan.backends.transport}")
    table.add_row("expert GEMMs", info["experts_gemm"])
    table.add_row("platform", "\n".join(platform))
    table.add_row("selection", plan.backends.describe())
    table.add_row("why", "\n".join(plan.backends.reasons))
    table.add_row("dispatch bytes / token / dest", f"{wb.dispatch_payload} + {wb.dispatch_scales} scales (+ {wb.dispatch_meta} routing meta)")
    table.add_row("combine bytes / (token, expert)", f"{wb.combine_payload} + {wb.combine_scales} scales")
    console.print(table)
    print(plan.startup_line())
    return 0
