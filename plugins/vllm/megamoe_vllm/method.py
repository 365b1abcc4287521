"""MegaMoEMethod: vLLM's routed-experts quant method, served by a MegaMoELayer.

It wraps the quant method vLLM would have chosen (``inner``):

- ``create_weights`` and the weight loaders stay vLLM's, so every checkpoint layout vLLM loads
  still loads, with vLLM's EP slicing (each rank loads only its experts);
- ``process_weights_after_loading`` converts the loaded tensors to MegaMoE ``ExpertWeights``
  (``weights.py``), builds the layer plan and frees vLLM's copies;
- ``apply`` takes the router's (topk_ids, topk_weights) for this rank's own tokens and runs
  dispatch -> experts -> combine through MegaMoE's transport over vLLM's EP process group.

``supports_internal_mk`` is True, which tells vLLM's MoE runner not to all-gather tokens across DP
ranks around the experts: MegaMoE's dispatch/combine replaces that step. Everything else the runner
does is kept — router (grouped top-k, correction bias, scaling), shared experts, the TP all-reduce.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from megamoe_backend.knobs import Knobs
from megamoe_backend.layer import MegaMoELayer
from megamoe_backend.layer.eplb import expose_expert_tensors
from megamoe_backend.plan import ExpertPlacement, LayerPlan, PlacementError, build_plan
from megamoe_backend.plan import token_bound
from megamoe_backend.platform import facts as platform_facts
from megamoe_backend.spec import MoESpec

from . import op
from .dp_bound import max_tokens_across_ranks
from .engine_checks import MegaMoEConfigError, engine_graphs
from .padding import PaddedIds, padding_rows
from .weights import ExpertFormat, expert_format_of, expert_weights_from_params

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

# vLLM parameter names the conversion reads (the rest of inner's parameters are left alone): MXFP4's E8M0
# scales are ``*_weight_scale``, block-FP8's fp32 block scales ``*_weight_scale_inv`` (Fp8MoEMethod).
_EXPERT_PARAMS = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_weight_scale_inv",
                  "w2_weight_scale_inv")


def check_deployment(moe_config: Any, knobs: Knobs | None = None) -> None:
    """Refuse configurations the adapter does not implement, at layer construction."""
    mpc = moe_config.moe_parallel_config
    max_tokens = getattr(moe_config, "max_num_tokens", None)
    if knobs is not None and isinstance(max_tokens, int) and max_tokens > knobs.max_tokens_per_rank:
        raise MegaMoEConfigError(
            f"--max-num-batched-tokens {max_tokens} exceeds MEGA_MAX_TOKENS_PER_RANK={knobs.max_tokens_per_rank}: "
            "a full batch could not be dispatched. Raise MEGA_MAX_TOKENS_PER_RANK or lower --max-num-batched-tokens."
        )
    if (mpc.dp_size > 1 or mpc.tp_size > 1 or mpc.pcp_size > 1) and not mpc.use_ep:
        raise MegaMoEConfigError(
            "--moe-backend megamoe_ep needs --enable-expert-parallel when tensor/data parallel size > 1 "
            f"(got tp={mpc.tp_size} dp={mpc.dp_size}); MegaMoE splits experts, not their weights"
        )
    if mpc.pcp_size > 1:
        raise MegaMoEConfigError("--moe-backend megamoe_ep does not support prefill context parallelism")
    if not moe_config.activation.is_gated or moe_config.activation.value not in ("silu",):
        raise MegaMoEConfigError(
            f"--moe-backend megamoe_ep computes SwiGLU experts; this model's activation is "
            f"{moe_config.activation.value!r}"
        )
    if moe_config.has_bias:
        raise MegaMoEConfigError("--moe-backend megamoe_ep: expert biases are not supported")
    if moe_config.is_lora_enabled:
        raise MegaMoEConfigError("--moe-backend megamoe_ep: LoRA on MoE layers is not supported")


EPLB_MAP = "vLLM's EPLB physical_to_logical map"


def vllm_placement(
    num_experts: int, ep_size: int, strategy: str, physical_to_logical: list[int] | None = None,
    num_logical: int | None = None,
) -> ExpertPlacement:
    """vLLM's expert -> (rank, local slot) assignment for every rank, as an ExpertPlacement.

    Built from vLLM's own ``determine_expert_map`` for each rank, so the local slots match the
    order in which vLLM's loader filled this rank's ``w13_weight`` / ``w2_weight``. With EPLB
    ``physical_to_logical`` is vLLM's map (``num_experts`` physical slots, contiguous per rank:
    vLLM falls back to linear placement under EPLB); each slot holds its logical expert's weights.
    """
    logical = tuple(range(num_experts)) if physical_to_logical is None else tuple(int(x) for x in physical_to_logical)
    if physical_to_logical is not None:
        if len(logical) != num_experts:
            raise PlacementError(f"{EPLB_MAP} has {len(logical)} physical experts, the layer has {num_experts}")
        eplb = ExpertPlacement.contiguous(list(logical), ep_size, num_logical, map_name=EPLB_MAP)
    if ep_size == 1:
        return ExpertPlacement(1, (0,) * num_experts, tuple(range(num_experts)), logical)
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    owner = [-1] * num_experts
    slot = [-1] * num_experts
    for rank in range(ep_size):
        _, expert_map, _ = determine_expert_map(ep_size, rank, num_experts, strategy)
        assert expert_map is not None
        for expert, local in enumerate(expert_map.tolist()):
            if local >= 0:
                owner[expert], slot[expert] = rank, local
    placement = ExpertPlacement(ep_size=ep_size, owner=tuple(owner), slot=tuple(slot), logical_of_physical=logical)
    if physical_to_logical is not None and (placement.owner, placement.slot) != (eplb.owner, eplb.slot):
        raise MegaMoEConfigError(
            f"vLLM placed the {num_experts} EPLB physical experts with strategy {strategy!r}, not contiguously per "
            "rank as EPLB rebalancing assumes; use --expert-placement-strategy linear"
        )
    return placement


def eplb_initial_map(moe_config: Any) -> list[int] | None:
    """vLLM's physical -> logical map at load time (its loader's own), or None without EPLB."""
    if not moe_config.moe_parallel_config.enable_eplb:
        return None
    from vllm.distributed.eplb.eplb_state import EplbState

    redundant = moe_config.num_experts - moe_config.num_logical_experts
    return list(EplbState.build_initial_global_physical_to_logical_map(moe_config.num_logical_experts, redundant))


class MegaMoEMethod:
    """Mixin body; the concrete class is built against vLLM's FusedMoEMethodBase in ``make_method``."""

    def _megamoe_init(self, inner: Any, knobs: Knobs, layer_name: str, sequence_parallel: bool) -> None:
        self.inner = inner
        self.sequence_parallel = sequence_parallel  # tokens already split over TP ranks
        self.knobs = knobs
        self.layer_name = layer_name
        self.fmt: ExpertFormat = expert_format_of(inner, knobs)
        self.runtime: MegaMoELayer | None = None
        self.plan: LayerPlan | None = None
        self.padded_ids: PaddedIds | None = None

    # --- what vLLM's runner asks -------------------------------------------------------------
    @property
    def supports_internal_mk(self) -> bool:
        return True  # MegaMoE dispatches and combines: no naive DP all-gather around us

    @property
    def mk_can_overlap_shared_experts(self) -> bool:
        return False  # the runner runs shared experts itself, before the routed ones

    @property
    def is_monolithic(self) -> bool:
        return False  # vLLM's router picks experts; MegaMoE takes ids + weights

    @property
    def supports_eplb(self) -> bool:
        return True  # the layer's parameters are MegaMoE's own tensors: vLLM's EPLB moves them (see expose_for_eplb)

    @property
    def topk_indices_dtype(self) -> torch.dtype | None:
        return None

    @property
    def method_name(self) -> str:
        return f"MegaMoEMethod[{self.fmt.source}]"

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config):
        return hidden_size, intermediate_size_per_partition  # no padding: checkpoint shapes as they are

    def create_weights(self, layer: "RoutedExperts", **kwargs: Any) -> None:
        self.inner.create_weights(layer=layer, **kwargs)

    def get_fused_moe_quant_config(self, layer: "RoutedExperts") -> Any:
        from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

        return FusedMoEQuantConfig.make()

    # --- load -> MegaMoE ---------------------------------------------------------------------
    def process_weights_after_loading(self, layer: "RoutedExperts") -> None:
        from vllm.distributed import get_ep_group

        moe = layer.moe_config
        mpc = moe.moe_parallel_config
        params = {n: getattr(layer, n).data for n in _EXPERT_PARAMS if getattr(layer, n, None) is not None}
        weights = expert_weights_from_params(params, self.fmt)

        spec = MoESpec(
            hidden_size=moe.hidden_dim,
            moe_intermediate_size=weights.intermediate,
            n_routed_experts=moe.num_experts,
            num_experts_per_tok=moe.experts_per_token,
            swiglu_limit=layer.swiglu_limit,
            quant=self.fmt.quant,
            name=self.layer_name,
        )
        placement = vllm_placement(moe.num_experts, mpc.ep_size, layer.expert_placement_strategy, eplb_initial_map(moe),
                                   moe.num_logical_experts)
        self.plan = build_plan(spec, self.knobs, ep_rank=mpc.ep_rank, ep_size=mpc.ep_size,
                               placement=placement, device_type=platform_facts.device_kind(weights.w1.device))
        from vllm.config import get_current_vllm_config

        group = None
        if mpc.ep_size > 1:
            ep_group = get_ep_group()
            if ep_group.rank_in_group != mpc.ep_rank or ep_group.world_size != mpc.ep_size:
                raise MegaMoEConfigError(
                    f"vLLM's EP group (rank {ep_group.rank_in_group} of {ep_group.world_size}) disagrees with "
                    f"the MoE parallel config (ep_rank {mpc.ep_rank} of {mpc.ep_size})"
                )
            group = ep_group.device_group
        # the layer settles MEGA_DISPATCH=auto over the EP group, then refuses (every rank alike, before its
        # buffers exist) a forward vLLM would capture but cannot be
        self.runtime = MegaMoELayer(self.plan, weights, group=group, device=weights.w1.device, name=self.layer_name,
                                    graphs=engine_graphs(get_current_vllm_config()))
        self.plan = self.runtime.plan
        self.padded_ids = PaddedIds(self.plan.mtpr, moe.experts_per_token, weights.w1.device)

        if mpc.enable_eplb:
            expose_for_eplb(layer, self.runtime, self.fmt.scale_param)
        else:  # MegaMoE holds the weights now; drop vLLM's copies (they are not read again)
            for name in params:
                getattr(layer, name).data = torch.empty(0, dtype=params[name].dtype, device=params[name].device)
        op.register_runtime(self.layer_name, self)

    # --- forward -----------------------------------------------------------------------------
    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        return op.routed_experts(x, topk_ids, topk_weights, self.layer_name)

    def forward_tokens(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The op body: MegaMoE over this rank's share of the tokens.

        Under TP (+EP, no sequence parallelism) every TP rank holds the same tokens and vLLM sums
        the MoE output over TP afterwards; each TP rank therefore sends a disjoint 1/tp slice and
        returns zeros elsewhere, so the sum is the full result and no token is computed twice.
        """
        assert self.runtime is not None, "MegaMoE runtime used before process_weights_after_loading"
        tp_size, tp_rank = (1, 0) if self.sequence_parallel else _tp_position()
        bound = self.bound_kwargs(x.shape[0], tp_size)
        # vLLM's padding mask covers the whole (unsplit) batch: padded rows reach no expert (padding.py)
        padding = None if self.sequence_parallel else padding_rows(x.shape[0])
        if tp_size == 1:
            ids = self.padded_ids.apply(topk_ids, padding)
            return self.runtime.forward(x, ids, topk_weights, **bound).to(x.dtype)
        chunk = math.ceil(x.shape[0] / tp_size)
        lo, hi = min(tp_rank * chunk, x.shape[0]), min((tp_rank + 1) * chunk, x.shape[0])
        ids = self.padded_ids.apply(topk_ids[lo:hi], None if padding is None else padding[lo:hi])
        out = torch.zeros_like(x)
        out[lo:hi] = self.runtime.forward(x[lo:hi], ids, topk_weights[lo:hi], **bound).to(x.dtype)
        return out

    def bound_kwargs(self, local_tokens: int, tp_split: int) -> dict[str, int]:
        """``max_tokens_across_ranks=`` for the device P2P forward (dp_bound.py); the other forwards
        refuse the argument. Python ints vLLM already holds: no device read."""
        return token_bound.bound_kwargs(
            self.runtime, lambda: max_tokens_across_ranks(local_tokens, tp_split, self.moe, self.plan.mtpr))


# ExpertWeights field -> the RoutedExperts parameter that carries it for vLLM's EPLB (the scales' suffix is
# the ExpertFormat's scale_param: "_scale" for MXFP4, "_scale_inv" for block-FP8)
EPLB_PARAMS = {"w1": "w13_weight", "w2": "w2_weight", "w1_scale": "w13_weight_scale", "w2_scale": "w2_weight_scale"}


def eplb_params(scale_param: str = "_scale") -> dict[str, str]:
    """EPLB_PARAMS with the scales under the names vLLM's quant method registered them."""
    return {**EPLB_PARAMS, "w1_scale": f"w13_weight{scale_param}", "w2_scale": f"w2_weight{scale_param}"}


def expose_for_eplb(layer: Any, runtime: MegaMoELayer, scale_param: str = "_scale") -> None:
    """Make the layer's expert parameters *be* the tensors MegaMoE computes with.

    vLLM's EPLB moves every parameter of the layer as ``weight.view(local_experts, -1)``
    (``RoutedExperts.get_expert_weights``, collected after loading) with in-place copies
    (``rearrange_expert_weights_inplace``); the replaced vLLM tensors are freed. vLLM 0.32 calls no
    quant-method hook after a rearrangement, and none is needed: from ``expert_tensors()`` on,
    MegaMoE keeps no state derived from these tensors.
    """
    expose_expert_tensors(layer, runtime, eplb_params(scale_param))


def _tp_position() -> tuple[int, int]:
    """(size, rank) of the attention TP group, over which vLLM replicates the MoE input tokens."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    size = get_tensor_model_parallel_world_size()
    return (size, get_tensor_model_parallel_rank()) if size > 1 else (1, 0)


def make_method(inner: Any, moe_config: Any, knobs: Knobs, layer_name: str) -> Any:
    """A FusedMoEMethodBase subclass instance wrapping ``inner`` (vLLM's own choice)."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    cls = _concrete_class(FusedMoEMethodBase)
    method = cls(moe_config)
    method._megamoe_init(inner, knobs, layer_name, bool(moe_config.is_sequence_parallel))
    return method


_CLASS_CACHE: dict[type, type] = {}


def _concrete_class(base: type) -> type:
    cls = _CLASS_CACHE.get(base)
    if cls is None:
        cls = type("MegaMoEFusedMoEMethod", (MegaMoEMethod, base), {})
        _CLASS_CACHE[base] = cls
    return cls
