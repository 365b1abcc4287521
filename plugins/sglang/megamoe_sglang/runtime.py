"""One SGLang ``FusedMoE`` layer -> its MegaMoE runtime (plan + converted weights + transport).

Built when SGLang's loader calls the layer's ``process_weights_after_loading`` (layer_runtime.py):
the weights are loaded and, with EPLB, placed by then. Everything MegaMoE needs is read from SGLang's
own objects: shapes from the layer's ``MoeRunnerConfig``, the format from its quant method, the EP
rank/size from the layer, the process group from SGLang's MoE-EP group, the physical -> logical
expert map from SGLang's EPLB metadata.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from megamoe_backend.knobs import Knobs
from megamoe_backend.layer import MegaMoELayer
from megamoe_backend.plan import ExpertPlacement, PlacementError, build_plan, check_wire_matches_quant
from megamoe_backend.plan.capture import EngineGraphs
from megamoe_backend.platform import facts as platform_facts
from megamoe_backend.spec import MoESpec

from .selection import BACKEND_NAME, MegaMoEConfigError, check_ep_divides
from .weights import expert_weights_from_params, layer_scheme

logger = logging.getLogger("megamoe")


def eplb_map_name(layer_id: int | None) -> str:
    return f"SGLang's expert-location physical_to_logical_map (layer {layer_id})"


def sglang_placement(
    num_physical: int, ep_size: int, physical_to_logical: list[int] | None = None,
    num_logical: int | None = None, layer_id: int | None = None,
) -> ExpertPlacement:
    """SGLang's expert layout: physical expert p lives on EP rank p // (E / ep) in slot p % (E / ep).

    With EPLB (``--ep-num-redundant-experts``, ``--init-expert-location``, ``--enable-eplb``) the
    router already returns *physical* ids and SGLang's loader filled each physical slot with its
    logical expert's weights, so the layout stays contiguous; ``physical_to_logical`` (that layer's
    row of ``ExpertLocationMetadata``) records whose weights each slot holds. A rebalance changes
    the row, never the layout.
    """
    check_ep_divides(num_physical, ep_size)
    logical = list(range(num_physical)) if physical_to_logical is None else [int(x) for x in physical_to_logical]
    if len(logical) != num_physical:
        raise MegaMoEConfigError(
            f"EPLB expert map has {len(logical)} physical experts, the layer has {num_physical}; "
            "the expert-location metadata does not match this model"
        )
    try:
        return ExpertPlacement.contiguous(logical, ep_size, num_logical, map_name=eplb_map_name(layer_id))
    except PlacementError as exc:
        raise MegaMoEConfigError(str(exc)) from None


def eplb_metadata(layer_id: int | None) -> tuple[list[int], int] | None:
    """(this layer's physical -> logical row, logical expert count) of SGLang's expert-location
    metadata, or None without it."""
    try:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        meta = get_global_expert_location_metadata()
    except Exception:
        return None
    if meta is None or layer_id is None:
        return None
    return meta.physical_to_logical_map_cpu[layer_id].tolist(), int(meta.num_logical_experts)


def eplb_moves_experts() -> bool:
    """--enable-eplb: SGLang's ExpertLocationUpdater rewrites the layers' expert tensors at run time."""
    try:
        from sglang.srt.runtime_context import get_exec

        return bool(get_exec().moe.enable_eplb)
    except Exception:  # not published (unit tests without a server)
        return False


def check_runner_config(cfg: Any) -> None:
    """Refuse expert math MegaMoE does not compute, naming what the model asked for."""
    if cfg.activation != "silu" or not cfg.is_gated:
        raise MegaMoEConfigError(
            f"--moe-a2a-backend {BACKEND_NAME} computes SwiGLU experts; this layer uses "
            f"activation={cfg.activation!r} gated={cfg.is_gated}"
        )
    if cfg.gemm1_alpha is not None or cfg.gemm1_clamp_limit is not None:
        raise MegaMoEConfigError(
            f"--moe-a2a-backend {BACKEND_NAME} computes DeepSeek's SwiGLU (clamp via swiglu_limit); this layer "
            f"asks for gemm1_alpha={cfg.gemm1_alpha} gemm1_clamp_limit={cfg.gemm1_clamp_limit} (a different activation)"
        )
    if cfg.apply_router_weight_on_input or cfg.no_combine:
        raise MegaMoEConfigError(
            f"--moe-a2a-backend {BACKEND_NAME}: router weight on input / no_combine are not supported"
        )
    if cfg.num_fused_shared_experts:
        raise MegaMoEConfigError(
            f"--moe-a2a-backend {BACKEND_NAME} runs shared experts outside the routed experts; "
            "add --disable-shared-experts-fusion (the plugin's resolution step sets it)"
        )


def layer_spec(layer: Any, quant: str) -> MoESpec:
    """The MoESpec of one SGLang FusedMoE layer (routing is SGLang's, so only shapes matter)."""
    cfg = layer.moe_runner_config
    return MoESpec(
        hidden_size=int(cfg.hidden_size),
        moe_intermediate_size=int(layer.intermediate_size_per_partition),
        n_routed_experts=int(cfg.num_experts),
        num_experts_per_tok=int(cfg.top_k),
        swiglu_limit=cfg.swiglu_limit,
        quant=quant,
        name=f"sglang-layer-{cfg.layer_id}",
    )


def convert_layer_weights(layer: Any, knobs: Knobs | None = None):
    """The layer's loaded expert parameters as MegaMoE ``ExpertWeights`` (interleaved, no padding)."""
    fmt, knobs = layer_scheme(layer, knobs or Knobs.from_env())  # knobs: with the wire the scheme choice runs
    check_wire_matches_quant(knobs.dispatch_wire, fmt.quant)  # at weight loading, not at the first forward
    params = {name: p.data for name, p in layer.named_parameters(recurse=False)}
    if any(t.is_meta for t in params.values()):
        raise MegaMoEConfigError(
            f"--moe-a2a-backend {BACKEND_NAME}: layer {layer.moe_runner_config.layer_id} still has its experts on "
            "the meta device (online quantisation / requantisation at load time); serve a checkpoint "
            "stored in the format MegaMoE runs (bf16, Quark MXFP4, DeepSeek V4 fp4)"
        )
    up_first = bool(getattr(layer.quant_method, "load_up_proj_weight_first", False))
    return expert_weights_from_params(params, fmt, int(layer.intermediate_size_per_partition), up_first)


def build_layer_runtime(
    layer: Any,
    group: Any,
    knobs: Knobs | None = None,
    device: torch.device | str | None = None,
    eplb: tuple[list[int], int] | None = None,
) -> MegaMoELayer:
    """A MegaMoELayer for ``layer`` (an SGLang FusedMoE whose weights are loaded) on EP ``group``;
    ``eplb``: (physical -> logical row, logical expert count) of SGLang's expert-location metadata."""
    knobs = knobs or Knobs.from_env()
    cfg = layer.moe_runner_config
    check_runner_config(cfg)
    if getattr(layer, "moe_tp_size", 1) != 1:
        raise MegaMoEConfigError(
            f"--moe-a2a-backend {BACKEND_NAME} splits experts, not their weights: set --ep-size equal to "
            f"--tp (MoE TP size is {layer.moe_tp_size})"
        )
    fmt, knobs = layer_scheme(layer, knobs)  # knobs: with the wire the scheme choice runs
    ep_rank, ep_size = int(layer.moe_ep_rank), int(layer.moe_ep_size)
    p2l, num_logical = eplb if eplb is not None else (None, None)
    placement = sglang_placement(int(cfg.num_experts), ep_size, p2l, num_logical, cfg.layer_id)
    weights = getattr(layer, "_megamoe_weights", None) or convert_layer_weights(layer, knobs)
    if weights.num_experts != placement.num_local(ep_rank):
        raise MegaMoEConfigError(
            f"layer {cfg.layer_id} holds {weights.num_experts} local experts, MegaMoE's placement gives "
            f"EP rank {ep_rank} {placement.num_local(ep_rank)}"
        )
    device = torch.device(device) if device is not None else weights.w1.device
    plan = build_plan(layer_spec(layer, fmt.quant), knobs, ep_rank, ep_size, placement,
                      device_type=platform_facts.device_kind(device))
    # the layer settles MEGA_DISPATCH=auto over the EP group, then refuses (every rank alike, before its
    # buffers exist) a forward SGLang would capture but cannot be
    return MegaMoELayer(plan, weights.to(device), group=group, device=device, layer_id=int(cfg.layer_id or 0),
                        graphs=EngineGraphs(sglang_captures_graphs(), "--disable-cuda-graph"))


def captures_graphs(cuda_graph_config: Any) -> bool:
    """Whether SGLang captures CUDA graphs under this ``CudaGraphConfig``: any phase whose backend is
    not ``disabled`` (--disable-cuda-graph disables both). None (not resolved: unit tests, a dummy
    model) counts as capturing, SGLang's default."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase

    if cuda_graph_config is None:
        return True
    return any(getattr(cuda_graph_config, phase).backend != Backend.DISABLED for phase in Phase.ALL)


def sglang_captures_graphs() -> bool:
    """``captures_graphs`` of this process's published configuration."""
    from sglang.srt.runtime_context import get_exec

    try:
        config = get_exec().graph.cuda_graph_config
    except ValueError:  # not published (unit tests without a server)
        config = None
    return captures_graphs(config)


def sglang_ep_group() -> Any:
    """SGLang's MoE expert-parallel process group (torch.distributed), or None for EP size 1."""
    from sglang.srt.distributed.parallel_state import get_moe_ep_group

    coordinator = get_moe_ep_group()
    return coordinator.device_group if coordinator.world_size > 1 else None
