"""`megamoe info`: print the resolved plan for a model and the current environment."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any, Mapping

from ..experts.registry import describe_experts_gemm
from ..knobs import KnobError, Knobs
from ..plan import ExpertPlacement, build_plan, facts_for, initial_redundant_map
from ..plan.layer_plan import check_ep_position
from ..spec import (ConfigError, EngineRelease, MoESpec, choose_scheme, preset, preset_config, read_config,
                    reading_for_config, resolve_config_path)
from ..spec.engine_reading import READ_RELEASES


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
    p.add_argument("--engine", default=None, metavar="ENGINE-VERSION",
                   help="read the checkpoint as this engine release's own quant method does (e.g. "
                        f"{', '.join(READ_RELEASES)}): vLLM 0.33+ runs DeepSeek V4 fp4 experts A8W4 on the fp8 "
                        "wire by default; without it, the checkpoint's own declaration (needs --model)")
    p.add_argument("--gfx-arch", default=None, metavar="ARCH",
                   help="with --device rocm: plan for this AMD GPU (gfx950, gfx1250) with the aiter / mori installed "
                        "here, as on that box (selection asks the installed aiter's plan builder)")
    p.add_argument("--gpu-memory-gb", type=float, default=None, metavar="GB",
                   help="compare the layer's memory with a GPU of this many GB (default: this machine's GPU, else an "
                        "H200's 141 GB)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def detect_device_type() -> str:
    import torch

    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return "cpu"


def load_spec(model: str | None, preset_name: str | None) -> MoESpec:
    if model:
        return MoESpec.from_config(resolve_config_path(model))
    return preset(preset_name or "dsv4-pro")


def load_config(model: str) -> Mapping[str, Any]:
    """The config.json mapping (the engine's reading looks at keys MoESpec does not keep)."""
    return read_config(resolve_config_path(model))


def engine_reading_for(args: argparse.Namespace, device: str):
    """The engine's reading of ``--model`` (or the preset's published checkpoint) under ``--engine``
    (None without --engine)."""
    if args.engine is None:
        return None, None
    release = EngineRelease.parse(args.engine)
    config = load_config(args.model) if args.model else preset_config(args.preset or "dsv4-pro")
    return release, reading_for_config(release, config, device, os.environ)


def _rocm_heap(plan) -> dict | None:
    """The heap figure of a fused AMD plan (experts/aiter/heap.py: what the start-up check uses)."""
    if not plan.backends.fused:
        return None
    from ..experts.aiter.heap import heap_report

    return heap_report(plan)


def auto_forecast(plan):
    """What MEGA_DISPATCH=auto will pick when the plan still waits for the EP group (CUDA), else None."""
    if not plan.backends.needs_ep_topology:
        return None
    from ..platform.auto_forecast import cuda_auto_forecast, local_topology
    from ..platform.topology import symm_mem_offered

    return cuda_auto_forecast(plan.backends.provider, plan.ep_size, symm_mem_offered(), local_topology(plan.ep_size))


def forecast_reason(reason: str, forecast) -> str:
    """``reason`` with select.py's pending auto answer ("transport nccl (MEGA_DISPATCH=auto): decided at
    start-up ...") replaced by the forecast: what auto picks and on which fact."""
    if reason.startswith("transport ") and "(MEGA_DISPATCH=auto)" in reason:
        return f"transport (MEGA_DISPATCH=auto): {forecast.describe()}"
    return reason


def memory_of(plan, device: str, forecast, gpu_memory_gb: float | None):
    """The layer's memory per GPU (layer/memory.py); under a pending auto: for what it picks on one host."""
    from ..layer.memory import layer_memory

    transport = None if forecast is None else (forecast.here or forecast.one_host)
    gpu = None if gpu_memory_gb is None else (f"GPU of {gpu_memory_gb:g} GB (--gpu-memory-gb)", int(gpu_memory_gb * 1e9))
    return layer_memory(plan, device, gpu, transport)


def run(args: argparse.Namespace) -> int:
    try:
        check_ep_position(args.ep_rank, args.ep_size)  # before anything is sized by them
        declared = load_spec(args.model, args.preset)
        knobs = Knobs.from_env()
        device = detect_device_type() if args.device == "auto" else args.device
        release, reading = engine_reading_for(args, device)
        # What the engines would run: the checkpoint's scheme x the engine's reading x the knobs (the plugins
        # call the same function on the reading of their engine's quant-method objects).
        choice = choose_scheme(declared.quant, reading, knobs, "config.json")
        spec = declared.scaled(quant=choice.quant)
        placement = None
        if args.redundant_experts:
            p2l = initial_redundant_map(spec.n_routed_experts, args.redundant_experts)
            placement = ExpertPlacement.contiguous(p2l, args.ep_size, spec.n_routed_experts,
                                                   map_name=f"--redundant-experts {args.redundant_experts} map")
        facts = facts_for(device, args.gfx_arch)
        plan = build_plan(spec, choice.knobs_for_layer(knobs), args.ep_rank, args.ep_size, placement=placement,
                          device_type=device, facts=facts)
        platform = facts.describe()
    except (KnobError, ConfigError, ValueError) as exc:
        print(f"megamoe info: error: {exc}")
        return 2
    wb = plan.wire_bytes()
    info = {
        "spec": spec.to_dict(),
        "declared_quant": declared.quant,
        "engine": None if release is None else str(release),
        "engine_reading": None if reading is None else {"scheme": reading.scheme, "source": reading.source},
        "scheme": {"runs": choice.quant, "dispatch_wire": choice.dispatch_wire, "overridden_by": choice.overridden_by,
                   "override_line": choice.override_line()},
        "knobs": knobs.to_dict(),
        "device": device,
        "platform": platform,
        "experts_provider": plan.backends.provider,
        "experts_gemm": describe_experts_gemm(knobs.experts_gemm, plan.backends.provider),
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
    forecast = auto_forecast(plan)
    if forecast is not None:  # not the pending placeholder: what auto picks, per the fact it depends on
        info["transport"] = f"auto: {forecast.one_host} on one host with peer access, else {forecast.several_hosts}"
        info["selection_reasons"] = [forecast_reason(r, forecast) for r in plan.backends.reasons]
    info["transport_auto"] = None if forecast is None else {
        "one_host": forecast.one_host, "shared_gpu": forecast.shared_gpu, "several_hosts": forecast.several_hosts,
        "depends_on": forecast.depends_on, "here": forecast.here, "line": forecast.describe()}
    memory = memory_of(plan, device, forecast, args.gpu_memory_gb)
    info["memory_per_gpu"] = memory.to_dict()
    heap = _rocm_heap(plan)  # the fused AMD runtimes' symmetric memory (docs/rocm.md)
    if heap is not None:
        info["rocm_heap"] = heap
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    transport = plan.backends.transport if forecast is None else f"auto->{forecast.here or forecast.one_host}|{forecast.several_hosts}"
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"MegaMoE plan: {spec.name or spec.model_type or 'model'}", show_header=False)
    for key in ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                "num_hidden_layers", "first_k_dense_replace", "n_group", "topk_group", "scoring_func", "topk_method",
                "routed_scaling_factor", "norm_topk_prob", "swiglu_limit"):
        table.add_row(key, str(getattr(spec, key)))
    table.add_row("quant", choice.describe())
    if release is not None:
        table.add_row("engine reading", f"{release}: {reading.source} -> {reading.scheme}" if reading else
                      f"{release}: names no activation format (the checkpoint's own scheme)")
    table.add_row("knobs", ", ".join(f"{k}={v}" for k, v in knobs.to_dict().items()))
    table.add_row("experts (EPLB)", f"{plan.placement.describe()} local/rank={plan.num_local_experts}")
    table.add_row("device / provider / transport", f"{device} / {plan.backends.provider} / {transport}")
    table.add_row("expert GEMMs", info["experts_gemm"])
    table.add_row("platform", "\n".join(platform))
    shown = plan.backends if forecast is None else dataclasses.replace(plan.backends, transport=transport)
    table.add_row("selection", shown.describe())
    table.add_row("why", "\n".join(info["selection_reasons"]))
    table.add_row("dispatch bytes / token / dest", f"{wb.dispatch_payload} + {wb.dispatch_scales} scales (+ {wb.dispatch_meta} routing meta)")
    table.add_row("combine bytes / (token, expert)", f"{wb.combine_payload} + {wb.combine_scales} scales")
    if forecast is not None:
        table.add_row("MEGA_DISPATCH=auto", f"{forecast.describe()}\n{forecast.depends_on}")
    table.add_row("memory per GPU", "\n".join(memory.lines()))
    if heap is not None:
        from ..experts.aiter.heap import describe_heap

        table.add_row("symmetric memory", describe_heap(heap))
    console.print(table)
    if choice.override_line():
        print(choice.override_line())
    if memory.warning():
        print(memory.warning())
    if forecast is None:
        print(plan.startup_line())
    else:  # the pending placeholder is not the decision: the line of what auto picks on one host (or on this one)
        print(f"MEGA_DISPATCH=auto: {forecast.describe()}; {forecast.depends_on}")
        picked = forecast.here or forecast.one_host
        where = "on this host" if forecast.here else "on one host with peer access"
        print(f"startup line when auto picks {picked} ({where}; {forecast.several_hosts}, eager, across hosts):")
        print(plan.startup_line(picked))
    return 0
