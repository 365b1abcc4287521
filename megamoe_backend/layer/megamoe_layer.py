"""MegaMoELayer: route-weighted MoE over expert-parallel ranks.

    [tokens] -> quantise once (dispatch wire) -> dispatch -> local experts (GEMM1 + SwiGLU + GEMM2,
    route weight in the epilogue) -> combine wire -> combine -> sum over top-k in fp32 -> [tokens]

Each (token, expert) contribution comes back as its own row and the source sums the top-k rows in
a fixed order, in fp32. That makes the bf16-wire result independent of the EP size (bit-identical
to the single-process layer), and a NaN token can only touch its own rows.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from ..experts import ExpertPairs, ExpertsProvider, ExpertWeights
from ..experts.registry import make_provider
from ..plan import LayerPlan
from ..transport import PeerInputError, Transport, get_transport, received_pairs
from ..transport.cache import cached_transport_keys, transport_key
from ..transport.layout import DispatchLayout
from ..transport.registry import make_transport

logger = logging.getLogger("megamoe")
if not logger.handlers:  # the startup line must reach engine logs even when nobody configured logging
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class MegaMoELayer:
    """One MoE layer's routed experts on this EP rank.

    ``weights`` holds this rank's local experts (``plan.num_local_experts`` of them, in local-slot
    order). ``group`` is the EP process group (None only for ep_size 1).
    """

    def __init__(
        self,
        plan: LayerPlan,
        weights: ExpertWeights,
        group: Any = None,
        device: torch.device | str | None = None,
        provider: ExpertsProvider | None = None,
        transport: Transport | None = None,
        layer_id: int = 0,
    ) -> None:
        spec = plan.spec
        if weights.num_experts != plan.num_local_experts:
            raise ValueError(
                f"weights hold {weights.num_experts} experts, ep_rank {plan.ep_rank} owns {plan.num_local_experts}"
            )
        if weights.hidden != spec.hidden_size or weights.intermediate != spec.moe_intermediate_size:
            raise ValueError(
                f"weights are hidden={weights.hidden} inter={weights.intermediate}, the spec says "
                f"hidden={spec.hidden_size} inter={spec.moe_intermediate_size}"
            )
        self.plan = plan
        self.weights = weights
        self.device = torch.device(device) if device is not None else weights.w1.device
        self._owner, self._slot = plan.placement.tables(self.device)
        if plan.backends.fused:
            # aiter's fused runtime owns dispatch, both GEMMs and combine (ROCm; see docs/rocm.md)
            from ..experts.aiter import AiterFusedMoE

            self.fused = AiterFusedMoE(plan, group, self.device, selection=plan.backends, layer_id=layer_id)
            self.fused_weights = self.fused.prepare_weights(weights)
            self.provider, self.transport = None, None
            return
        self.fused = None
        self.provider = provider or make_provider(plan.backends.provider, capacity=plan.mtpr * plan.topk * plan.ep_size)
        self.weights = self.provider.prepare_weights(weights, plan.math)
        if transport is None:
            key = transport_key(plan.layout_key(), group, self.device)
            is_new = key not in cached_transport_keys()
            transport = get_transport(plan.layout_key(), group, self.device, lambda: make_transport(plan, group, self.device))
            if is_new:
                logger.info(plan.startup_line(transport.name))
        self.transport = transport

    def expert_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this rank's experts compute with (the provider-prepared ``self.weights``), by
        field, each contiguous with one row per local slot: what an engine's EPLB moves between ranks
        in place (vLLM ``get_expert_weights``, SGLang ``get_moe_weights``). From this call on the
        provider keeps nothing derived from them, so every forward reads what the engine moved there;
        the placement's physical ids never move (only which logical expert a slot holds), so the
        routing tables stay valid.
        """
        if self.fused is not None:
            raise NotImplementedError(
                "[megamoe] EPLB with aiter's fused runtime is not supported: its weights are aiter-shuffled "
                "copies that no engine can move per expert; serve without EPLB there (ROCm)"
            )
        tensors = self.weights.expert_tensors()
        self.provider.weights_become_movable(self.weights)
        return tensors

    def _check_inputs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[int, str]:
        """(status, message) for this rank's input; status != 0 is reported to every rank."""
        plan = self.plan
        if x.dim() != 2 or x.shape[1] != plan.hidden:
            return 3, f"hidden_states must be [tokens, {plan.hidden}], got {tuple(x.shape)}"
        t = x.shape[0]
        if tuple(topk_ids.shape) != (t, plan.topk) or tuple(topk_weights.shape) != (t, plan.topk):
            return 3, (
                f"topk_ids / topk_weights must be [{t}, {plan.topk}], got {tuple(topk_ids.shape)} / "
                f"{tuple(topk_weights.shape)}"
            )
        if t > plan.mtpr:
            return 1, (
                f"{t} tokens on ep_rank {plan.ep_rank} exceed MEGA_MAX_TOKENS_PER_RANK={plan.mtpr}; "
                "raise the knob (or the engine's max batched tokens must stay below it); no token was dropped"
            )
        if t and (bool((topk_ids < -1).any()) or bool((topk_ids >= plan.placement.num_physical).any())):
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            return 2, (
                f"topk_ids hold values in [{lo}, {hi}]; valid are -1 (masked) and 0..{plan.placement.num_physical - 1}"
            )
        return 0, ""

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, output_scale: float = 1.0
    ) -> torch.Tensor:
        """x [T, H] (bf16/fp32), topk_ids [T, k] (-1 = masked), topk_weights [T, k] -> bf16 [T, H].

        ``output_scale`` multiplies the fp32 sum before the one bf16 rounding (engines that apply
        routed_scaling_factor after the experts pass it here instead of rounding twice).
        """
        plan = self.plan
        status, message = self._check_inputs(x, topk_ids, topk_weights)
        if self.fused is not None:
            if status:
                raise PeerInputError(f"[megamoe] {message}")
            out = self.fused(x, topk_ids, topk_weights, self.fused_weights)
            return out if output_scale == 1.0 else (out.float() * output_scale).to(torch.bfloat16)
        if status:
            # Still take part in the header exchange with nothing to send, so peers fail fast too.
            x = torch.zeros(0, plan.hidden, dtype=torch.bfloat16, device=self.device)
            topk_ids = torch.zeros(0, plan.topk, dtype=torch.int64, device=self.device)
            topk_weights = torch.zeros(0, plan.topk, dtype=torch.float32, device=self.device)
        topk_ids = topk_ids.to(torch.int64)
        token_rows = plan.dispatch.encode(x)  # one quantisation per token, whatever the fan-out
        layout = DispatchLayout.build(topk_ids, topk_weights, self._owner, self._slot, plan.ep_size)
        try:
            received = self.transport.dispatch(token_rows, layout, status)
        except PeerInputError as exc:
            if status:
                raise PeerInputError(f"[megamoe] {message}") from exc
            raise

        rows_a = plan.dispatch.decode(received.rows, plan.hidden)
        pair_row, pair_k = received_pairs(received.slots)
        pairs = ExpertPairs(
            row=pair_row,
            slot=received.slots[pair_row, pair_k].to(torch.int64),
            weight=received.weights[pair_row, pair_k],
        )
        if getattr(self.transport, "reduces_in_combine", False):
            # mori sums a token's rows across ranks inside its combine kernel (and quantises there)
            contributions = self.provider.forward(rows_a, pairs, self.weights, plan.math)
            summed = self.transport.combine_reduced(contributions, received.handle)
            return (summed * output_scale).to(torch.bfloat16)
        # the provider writes the combine wire rows (Triton: in GEMM2's epilogue, no fp32 rows in memory)
        pair_wire_rows = self.provider.forward_wire(rows_a, pairs, self.weights, plan.math, plan.combine)
        returned = self.transport.combine(pair_wire_rows, received.handle)

        values = plan.combine.decode_fp32(returned, plan.hidden)
        per_topk = torch.zeros(layout.num_tokens, plan.topk, plan.hidden, dtype=torch.float32, device=self.device)
        per_topk[layout.pair_token, layout.pair_k] = values
        summed = per_topk.sum(dim=1)
        if output_scale != 1.0:
            summed = summed * output_scale
        return summed.to(torch.bfloat16)

    __call__ = forward
