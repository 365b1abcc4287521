"""MegaMoELayer: route-weighted MoE over expert-parallel ranks.

    [tokens] -> quantise once (dispatch wire) -> dispatch -> local experts (GEMM1 + SwiGLU + GEMM2,
    route weight in the epilogue) -> combine wire -> combine -> sum over top-k in fp32 -> [tokens]

Each (token, expert) contribution comes back as its own row and the source sums the top-k rows in
a fixed order, in fp32. That makes the bf16-wire result independent of the EP size (bit-identical
to the single-process layer), and a NaN token can only touch its own rows.

The layer builds ONE forward object at construction (layer/forwards/), the one the forward oracle
names (plan/forward_choice.py, ``self.forward_choice``): the device forward (CUDA, Triton experts,
ep_size 1), the device P2P forward (ep_size > 1 over MEGA_DISPATCH=symm | ipc, or the one-process
emulator's arenas), the mori device forward (ROCm), the torch forward over a Transport (CPU / gloo,
NCCL, mori) or aiter's fused runtime (ROCm). They compute the same thing; all but the torch forward
are sync-free and captured in CUDA graphs, with data checks reported through a status word.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from ..experts import ExpertsProvider, ExpertWeights
from ..experts.registry import make_provider
from ..plan import LayerPlan
from ..plan.capture import EngineGraphs
from ..plan.forward_choice import ForwardChoice
from ..plan.placement import PlacementError
from ..transport import Transport
from . import startup
from .memory import humming_scratch_of
from .forwards import DeviceForward, FusedForward, LayerForward, MoriForward, P2PForward, TorchForward


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
    order). ``group`` is the EP process group (None only for ep_size 1; an ``EmulatedGroup`` for the
    one-process emulator, benchmarks/emulated_ep.py). ``path`` is the forward object that runs it, the
    one ``forward_choice`` names. ``graphs``: the engine's CUDA-graph setting (plugins); with it the
    layer refuses, at construction and on every rank alike, a forward the engine would capture but
    cannot be (layer/startup.py). ``device_path`` (tests, the emulator): True asks for a device forward,
    False for the torch forward; ``transport``: a Transport for the torch forward (or mori's device
    forward, with ``device_path=True``).
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
        device_path: bool | None = None,
        name: str | None = None,
        graphs: EngineGraphs | None = None,
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
        self.name = name or f"layer {layer_id}"
        self.device = torch.device(device) if device is not None else weights.w1.device
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" -> "cuda:N", as tensors report it
            self.device = torch.device("cuda", torch.cuda.current_device())
        provider_name = None if provider is None else getattr(provider, "name", "")
        if transport is None and device_path is not False:
            # MEGA_DISPATCH=auto on CUDA: ipc / symm / nccl, with the group; then the engine's capture rule
            self.plan = plan = startup.settle_plan(plan, group, self.device, graphs, provider=provider_name)
        self.forward_choice: ForwardChoice = startup.forward_choice(
            plan, self.device, provider=provider_name, engine_captures=None if graphs is None else graphs.captures,
            device_forward=device_path, transport_given=transport is not None)
        if self.forward_choice.pending:
            raise ValueError(f"[megamoe] {self.name}: {self.forward_choice.why}; this layer cannot gather it (group "
                             f"{'None' if group is None else 'given'}, device {self.device}): pass the EP process "
                             "group on a CUDA device, or set MEGA_DISPATCH=symm | ipc | nccl")
        self.owner, self.slot = plan.placement.tables(self.device)
        self.provider: ExpertsProvider | None = None
        if self.forward_choice.forward == "fused":
            # aiter's fused runtime owns dispatch, both GEMMs and combine (ROCm; see docs/rocm.md)
            self.path: LayerForward = FusedForward(self, group, layer_id)
            return
        self.provider = provider or make_provider(plan.backends.provider, capacity=plan.mtpr * plan.topk * plan.ep_size,
                                                  knobs=plan.knobs, device=self.device, quant=plan.math.quant,
                                                  ep_size=plan.ep_size, humming_scratch=humming_scratch_of(plan))
        self.weights = self.provider.prepare_weights(weights, plan.math)
        self.path = build_forward(self.forward_choice.forward, self, group, transport)

    @property
    def transport_name(self) -> str:
        """What moves this layer's rows, as its startup line says it."""
        return self.path.name

    @property
    def workspace(self):
        """The device forwards' buffers (None on the torch and fused paths)."""
        return self.path.workspace

    @property
    def transport(self) -> Transport | None:
        return getattr(self.path, "transport", None)

    @property
    def fused(self):
        return getattr(self.path, "fused", None)

    @property
    def takes_token_bound(self) -> bool:
        """Whether ``forward(max_tokens_across_ranks=)`` applies: the oracle's answer (every forward but
        the ep_size-1 device forward); engines pass their DP-padded batch bound only then."""
        return self.forward_choice.takes_token_bound

    def raise_if_bad_input(self) -> None:
        """Raise what the device checks recorded in earlier forwards (finished on the GPU) and clear it.

        Called at the start of every eager forward; engines that replay CUDA graphs may call it once
        per step (a host read of pinned memory: no stall). A peer that timed out (P2P forward) leaves
        the workspace broken: every later forward of this shape raises the same error at once."""
        self.path.raise_if_bad_input()

    def expert_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this rank's experts compute with (the provider-prepared ``self.weights``), by
        field, each contiguous with one row per local slot: what an engine's EPLB moves between ranks
        in place (vLLM ``get_expert_weights``, SGLang ``get_moe_weights``). From this call on the
        provider keeps nothing derived from them, so every forward reads what the engine moved there;
        the placement's physical ids never move (only which logical expert a slot holds), so the
        routing tables stay valid.
        """
        if self.fused is not None:
            raise PlacementError(
                "[megamoe] EPLB with aiter's fused runtime is not supported: its weights are aiter-shuffled "
                "copies that no engine can move per expert; serve without EPLB there (ROCm)"
            )
        tensors = self.weights.expert_tensors()
        self.provider.weights_become_movable(self.weights)
        return tensors

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, output_scale: float = 1.0,
        out: torch.Tensor | None = None, max_tokens_across_ranks: int | None = None,
    ) -> torch.Tensor:
        """x [T, H] (bf16/fp32), topk_ids [T, k] (-1 = masked), topk_weights [T, k] -> bf16 [T, H].

        ``output_scale`` multiplies the fp32 sum before the one bf16 rounding (engines that apply
        routed_scaling_factor after the experts pass it here instead of rounding twice). ``out``
        (device forwards only) is a bf16 [T, H] buffer to write instead of a new tensor.
        ``max_tokens_across_ranks`` (EP forwards, ``takes_token_bound``): the most tokens any rank
        brings to this forward, the SAME number on every rank (DP-padded batch sizes, as engines
        replay one graph size on all ranks). The device P2P forward sizes its receive regions and
        tile config by it instead of MEGA_MAX_TOKENS_PER_RANK (the work follows the live rows either
        way); the torch forward sizes nothing by it but holds the same rules. Ranks that disagree get
        an error (the P2P barrier's check, the torch forward's dispatch header), not silent garbage.
        """
        return self.path(x, topk_ids, topk_weights, output_scale, out, max_tokens_across_ranks)

    __call__ = forward


def build_forward(kind: str, layer: MegaMoELayer, group: Any, transport: Transport | None) -> LayerForward:
    """The forward object of the oracle's ``kind`` (ForwardChoice.forward; "fused" is built before the
    experts provider, in MegaMoELayer)."""
    if kind == "device":
        return DeviceForward(layer)
    if kind == "p2p":
        return P2PForward(layer, group)
    if kind == "mori":  # ROCm: layer/forwards/mori.py
        return MoriForward(layer, group, transport)
    if kind == "torch":
        return TorchForward(layer, group, transport)
    raise ValueError(f"no forward object for the oracle's answer {kind!r}")  # a new ForwardChoice.forward
