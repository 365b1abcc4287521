"""`megamoe info`'s answer: the plan for a model on the target host, with what it assumed to get there.

Why apart from cli/info.py: this imports torch and the whole package (seconds); the command's arguments
and ``--help`` must not. Why the assumptions: ``megamoe info --device cuda`` usually runs on a laptop or
a CPU box, not on the GPU host it plans for. It then plans with the GPU host's required software (Triton
for CUDA: README, Requirements) instead of this machine's, and says so; facts it cannot know (an AMD GPU's
arch without ``--gfx-arch``, the engine without ``--engine``) are named as such, with the flag that gives them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from ..experts.base import A_OPERAND
from ..experts.gemm_choice import GemmChoice
from ..experts.registry import describe_experts_gemm, experts_gemm_choice
from ..knobs import Knobs
from ..layer.memory import LayerMemory, gpu_memory, humming_scratch_of, layer_memory
from ..plan import ExpertPlacement, LayerPlan, build_plan, facts_for, initial_redundant_map
from ..plan.forward_choice import ForwardChoice, ForwardFacts, choose_forward
from ..plan.layer_plan import check_ep_position
from ..platform import PackageInfo, PlatformFacts
from ..platform.auto_forecast import AutoForecast, cuda_auto_forecast, local_topology
from ..platform.topology import symm_mem_offered
from ..spec import (EngineRelease, MoESpec, SchemeChoice, choose_scheme, preset, preset_config, read_config,
                    reading_for_config, resolve_config_path)
from ..spec.engine_reading import READ_RELEASES, release_served

# what a CUDA GPU host runs MegaMoE with (README, Requirements): planned for when this machine is not one
CUDA_HOST_PACKAGES = {"triton": PackageInfo("triton", True, "assumed (the GPU host's, >= 3.4)")}


def detect_device_type() -> str:
    import torch

    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return "cpu"


def planned_facts(device: str, here: str, gfx_arch: str | None) -> tuple[PlatformFacts, list[str]]:
    """The facts to plan ``device`` with from a machine whose device is ``here``, and the lines saying what
    was assumed rather than seen (none when ``device`` is this machine's)."""
    facts = facts_for(device, gfx_arch)
    assumed = []
    if device == "cuda" and here != "cuda":
        facts = dataclasses.replace(facts, packages={**facts.packages, **CUDA_HOST_PACKAGES})
        assumed.append(f"guessing the GPU host: no CUDA GPU here ({here}), so planned with what a CUDA host runs "
                       "MegaMoE with (torch with Triton >= 3.4: the Triton experts); run megamoe info on the GPU "
                       "host for its own answer")
    if device == "rocm" and facts.gfx_arch is None:
        assumed.append("guessing the GPU: no AMD GPU here and no --gfx-arch, so no fused aiter runtime is planned; "
                       "pass --gfx-arch gfx950 (MegaMoEV2) or gfx1250 (MegaMoEGfx1250) for what that GPU runs")
    return facts, assumed


def engine_note(release: EngineRelease | None, declared: str, config: Mapping[str, Any], device: str) -> str | None:
    """Without --engine: where an engine release reads this checkpoint otherwise than its config.json does
    (vLLM 0.33+ runs DeepSeek V4's fp4 experts A8W4 on the fp8 wire), the line naming them and the flag."""
    if release is not None:
        return None
    readings = {r: reading_for_config(EngineRelease.parse(r), config, device, os.environ) for r in READ_RELEASES}
    differ = {r: x.scheme for r, x in readings.items() if x is not None and x.scheme != declared}
    if not differ:
        return None
    runs = "; ".join(f"{r} runs {scheme} on the {A_OPERAND[scheme]} wire" for r, scheme in differ.items())
    return (f"no --engine: the checkpoint's own scheme ({declared}); {runs} (the engine's reading of the checkpoint, "
            f"MEGA_DISPATCH_WIRE unset): pass --engine {next(iter(differ))} for that answer")


def auto_forecast(plan: LayerPlan) -> AutoForecast | None:
    """What MEGA_DISPATCH=auto will pick when the plan still waits for the EP group (CUDA), else None."""
    if not plan.backends.needs_ep_topology:
        return None
    return cuda_auto_forecast(plan.backends.provider, plan.ep_size, symm_mem_offered(), local_topology(plan.ep_size))


def forecast_reason(reason: str, forecast: AutoForecast) -> str:
    """``reason`` with select.py's pending auto answer ("transport nccl (MEGA_DISPATCH=auto): decided at
    start-up ...") replaced by the forecast: what auto picks and on which fact."""
    if reason.startswith("transport ") and "(MEGA_DISPATCH=auto)" in reason:
        return f"transport (MEGA_DISPATCH=auto): {forecast.describe()}"
    return reason


def forward_for(plan: LayerPlan, device: str, transport: str | None = None) -> ForwardChoice:
    """The forward oracle's answer for ``plan`` on ``device`` (the layer asks the same), or for the plan
    over ``transport`` instead (what MEGA_DISPATCH=auto's forecast pick would run)."""
    facts = ForwardFacts.of(plan, device)
    return choose_forward(facts if transport is None else dataclasses.replace(facts, transport=transport))


def forward_fields(choice: ForwardChoice) -> dict:
    """The oracle's answer as ``megamoe info --json`` prints it."""
    return {"forward": choice.forward, "moves_rows": choice.moves_rows, "capturable": choice.capturable,
            "takes_token_bound": choice.takes_token_bound, "why": choice.why}


def describe_forward(choice: ForwardChoice) -> str:
    """The oracle's answer in one line of the info table."""
    capture = {True: "capturable", False: "eager only", None: "capture judged once settled"}[choice.capturable]
    bound = "takes" if choice.takes_token_bound else "takes no"
    return f"{choice.forward} ({capture}; {bound} token bound): {choice.why}"


@dataclass
class InfoPlan:
    """Everything `megamoe info` prints, computed once."""

    declared: MoESpec
    spec: MoESpec
    release: EngineRelease | None
    release_note: str | None
    reading: Any
    choice: SchemeChoice
    knobs: Knobs  # from the environment
    layer_knobs: Knobs  # what the layer is built with (the engine's reading may set the dispatch wire)
    device: str
    facts: PlatformFacts
    assumed: list[str]
    plan: LayerPlan
    forecast: AutoForecast | None
    memory: LayerMemory
    heap: dict | None
    forward: ForwardChoice  # the oracle's answer for the plan (pending while auto waits for the EP group)
    startup_forward: ForwardChoice  # the forward the startup line shows: the forecast's pick where pending
    gemm: GemmChoice  # who runs the expert GEMMs (experts/gemm_choice.py), "pending" when planned off the GPU host

    def startup_line(self) -> str:
        """The layer's startup line as this plan logs it (``experts_provider=humming`` where humming-kernels runs)."""
        experts = "humming" if self.gemm.gemm == "humming" and self.plan.backends.provider == "triton" else None
        return self.plan.startup_line(self.startup_forward.moves_rows, experts=experts)

    @property
    def transport(self) -> str:
        f = self.forecast
        return self.plan.backends.transport if f is None else f"auto->{f.here or f.one_host}|{f.several_hosts}"

    def knobs_line(self) -> str:
        """The knobs the layer runs with; a dispatch wire the environment did not set says where it came from."""
        parts = []
        for key, value in self.layer_knobs.to_dict().items():
            if key == "dispatch_wire_set":
                continue
            if key == "dispatch_wire" and not self.knobs.dispatch_wire_set:
                source = "the engine's reading" if self.choice.reading else "the default"
                value = f"{value} (MEGA_DISPATCH_WIRE unset: {source})"
            parts.append(f"{key}={value}")
        return ", ".join(parts)


def load_spec(model: str | None, preset_name: str | None) -> MoESpec:
    if model:
        return MoESpec.from_config(resolve_config_path(model))
    return preset(preset_name or "dsv4-pro")


def model_config(args: argparse.Namespace) -> Mapping[str, Any]:
    """The config.json mapping of ``--model`` (or the preset's published checkpoint)."""
    return read_config(resolve_config_path(args.model)) if args.model else preset_config(args.preset or "dsv4-pro")


def resolve(args: argparse.Namespace) -> InfoPlan:
    """The plan for ``args``; KnobError / ConfigError / ValueError name the flag or knob at fault."""
    check_ep_position(args.ep_rank, args.ep_size)  # before anything is sized by them
    declared = load_spec(args.model, args.preset)
    knobs = Knobs.from_env()
    here = detect_device_type()
    device = here if args.device == "auto" else args.device
    release = None if args.engine is None else EngineRelease.parse(args.engine)
    release_note = None if release is None else release_served(release)
    config = model_config(args)
    reading = reading_for_config(release, config, device, os.environ)
    # What the engines would run: the checkpoint's scheme x the engine's reading x the knobs (the plugins
    # call the same function on the reading of their engine's quant-method objects).
    choice = choose_scheme(declared.quant, reading, knobs, "config.json")
    release_note = release_note or engine_note(release, declared.quant, config, device)
    spec = declared.scaled(quant=choice.quant)
    placement = None
    if args.redundant_experts:
        p2l = initial_redundant_map(spec.n_routed_experts, args.redundant_experts)
        placement = ExpertPlacement.contiguous(p2l, args.ep_size, spec.n_routed_experts,
                                               map_name=f"--redundant-experts {args.redundant_experts} map")
    facts, assumed = planned_facts(device, here, args.gfx_arch)
    layer_knobs = choice.knobs_for_layer(knobs)
    plan = build_plan(spec, layer_knobs, args.ep_rank, args.ep_size, placement=placement, device_type=device,
                      facts=facts)
    forecast = auto_forecast(plan)
    transport = None if forecast is None else (forecast.here or forecast.one_host)
    gpu = None if args.gpu_memory_gb is None else (f"GPU of {args.gpu_memory_gb:g} GB (--gpu-memory-gb)",
                                                   int(args.gpu_memory_gb * 1e9))
    gpu = gpu or gpu_memory(device)
    gemm = experts_gemm_choice(layer_knobs.experts_gemm, device, plan.math.quant, plan.ep_size, humming_scratch_of(plan),
                               gpu[1])
    memory = layer_memory(plan, device, gpu, transport, gemm.gemm)
    heap = None
    if plan.backends.fused:  # the fused AMD runtimes' symmetric memory (docs/rocm.md)
        from ..experts.aiter.heap import heap_report

        heap = heap_report(plan)
    forward = forward_for(plan, device)
    startup_forward = forward if transport is None else forward_for(plan, device, transport)
    return InfoPlan(declared, spec, release, release_note, reading, choice, knobs, layer_knobs, device, facts,
                    assumed, plan, forecast, memory, heap, forward, startup_forward, gemm)


def info_dict(r: InfoPlan) -> dict:
    """The JSON ``megamoe info --json`` prints."""
    plan, wb = r.plan, r.plan.wire_bytes()
    info = {
        "spec": r.spec.to_dict(),
        "declared_quant": r.declared.quant,
        "engine": None if r.release is None else str(r.release),
        "engine_note": r.release_note,
        "engine_reading": None if r.reading is None else {"scheme": r.reading.scheme, "source": r.reading.source},
        "scheme": {"runs": r.choice.quant, "dispatch_wire": r.choice.dispatch_wire,
                   "overridden_by": r.choice.overridden_by, "override_line": r.choice.override_line()},
        "knobs": {k: v for k, v in r.layer_knobs.to_dict().items() if k != "dispatch_wire_set"},
        "knobs_from_env": r.knobs.to_dict(),
        "device": r.device,
        "assumed": r.assumed,
        "platform": r.facts.describe(),
        "experts_provider": plan.backends.provider,
        "experts_gemm": describe_experts_gemm(r.layer_knobs.experts_gemm, plan.backends.provider, r.device,
                                              plan.math.quant),
        "experts_gemm_choice": {"gemm": r.gemm.gemm, "why": r.gemm.why},
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
        "combine_bytes_per_token_expert_pair": {"payload": wb.combine_payload, "scales": wb.combine_scales,
                                                "row": wb.combine_row},
        "forward": forward_fields(r.forward),
        "startup_line": r.startup_line(),
    }
    forecast = r.forecast
    if forecast is not None:  # beside the pending answer: what auto picks, per the fact it depends on
        info["transport"] = f"auto: {forecast.one_host} on one host with peer access, else {forecast.several_hosts}"
        info["selection_reasons"] = [forecast_reason(x, forecast) for x in plan.backends.reasons]
    info["transport_auto"] = None if forecast is None else {
        "one_host": forecast.one_host, "shared_gpu": forecast.shared_gpu, "several_hosts": forecast.several_hosts,
        "depends_on": forecast.depends_on, "here": forecast.here, "line": forecast.describe()}
    info["memory_per_gpu"] = r.memory.to_dict()
    if r.heap is not None:
        info["rocm_heap"] = r.heap
    return info


__all__ = ["InfoPlan", "describe_forward", "forward_for", "info_dict", "planned_facts", "resolve"]
