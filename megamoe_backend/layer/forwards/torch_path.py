"""The torch forward: a Transport (torch.distributed NCCL / gloo, mori) moves the rows; the dispatch
layout is built in torch and data checks run on the host, so it runs eagerly (CPU, gloo, and EP
over NCCL on CUDA). Every rank takes part in the exchange even with bad input, so peers fail fast.

``max_tokens_across_ranks``: nothing here is sized by it (the exchange moves the rows there are),
but it holds the same contract as on the device P2P forward, which is sized by it: this rank's
tokens <= bound <= MEGA_MAX_TOKENS_PER_RANK (else status 4, refused on every rank like bad ids),
and one number on every rank (the dispatch header carries each rank's bound: ranks that disagree
raise the same error on every rank, as the P2P barrier's check does). So an engine that passes a
wrong bound fails on a CPU run as it would on the GPU, instead of only where the bound sizes work.
"""

from __future__ import annotations

import logging

import torch

from ...experts import ExpertPairs
from ...plan.token_bound import bound_problem
from ...transport import PeerInputError, Transport, get_transport, received_pairs
from ...transport.cache import cached_transport_keys, transport_key
from ...transport.bound_header import NO_BOUND
from ...transport.layout import DispatchLayout
from ...transport.registry import make_transport
from .base import LayerForward, refuse_capture

logger = logging.getLogger("megamoe")


def host_input_status(path: LayerForward, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[int, str]:
    """(status, message) for this rank's input: shapes, then the ids on the host (eager paths only)."""
    status, message = path.shape_status(x, topk_ids, topk_weights)
    if status:
        return status, message
    num_physical = path.plan.placement.num_physical
    if x.shape[0] and (bool((topk_ids < -1).any()) or bool((topk_ids >= num_physical).any())):
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        return 2, f"topk_ids hold values in [{lo}, {hi}]; valid are -1 (masked) and 0..{num_physical - 1}"
    return 0, ""


BOUND_OUT_OF_RANGE = 4  # the transports' status 4 (transport/torch_dist.py STATUS_MEANING)


def bound_word(max_tokens_across_ranks: int | None) -> int:
    """The bound as the dispatch header carries it (NO_BOUND: the forward got none)."""
    return NO_BOUND if max_tokens_across_ranks is None else int(max_tokens_across_ranks)


class TorchForward(LayerForward):
    def __init__(self, layer, group, transport: Transport | None) -> None:
        super().__init__(layer.plan, layer.device, layer.name)
        self.provider, self.weights = layer.provider, layer.weights
        self.owner, self.slot = layer.owner, layer.slot
        plan = self.plan
        if transport is None:
            key = transport_key(plan.layout_key(), group, self.device)
            is_new = key not in cached_transport_keys()
            transport = get_transport(plan.layout_key(), group, self.device, lambda: make_transport(plan, group, self.device))
            if is_new:
                logger.info(plan.startup_line(transport.name, experts=self.provider.name))
        self.transport = transport

    @property
    def name(self) -> str:
        return self.transport.name

    def __call__(self, x, topk_ids, topk_weights, output_scale, out, max_tokens_across_ranks):
        plan = self.plan
        if out is not None:
            raise ValueError("[megamoe] out= is supported by the device forwards only")
        refuse_capture(self)
        status, message = host_input_status(self, x, topk_ids, topk_weights)
        if not status and (problem := bound_problem(x.shape[0], max_tokens_across_ranks, plan.mtpr)):
            status, message = BOUND_OUT_OF_RANGE, f"{self.layer_name}: {problem}"
        if status:
            # Still take part in the header exchange with nothing to send, so peers fail fast too.
            x = torch.zeros(0, plan.hidden, dtype=torch.bfloat16, device=self.device)
            topk_ids = torch.zeros(0, plan.topk, dtype=torch.int64, device=self.device)
            topk_weights = torch.zeros(0, plan.topk, dtype=torch.float32, device=self.device)
        topk_ids = topk_ids.to(torch.int64)
        token_rows = plan.dispatch.encode(x)  # one quantisation per token, whatever the fan-out
        layout = DispatchLayout.build(topk_ids, topk_weights, self.owner, self.slot, plan.ep_size)
        try:
            received = self.transport.dispatch(token_rows, layout, status, bound=bound_word(max_tokens_across_ranks))
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
