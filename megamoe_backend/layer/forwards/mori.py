"""The mori device forward (ROCm, Triton experts, EP over mori's EpDispatchCombineOp): no host
synchronisation, fixed buffers, so it can be captured like the CUDA device forwards.

    ids -> rank-major mori ids on the device (bad ids: status word) -> [quantise once] -> mori
    dispatch (mori's buffer, its row count ``total_recv`` on the device) -> local slots of the live
    received rows -> Triton experts over the live rows (LiveRows: a count on the device) -> each
    received row's sum of its local pairs (live rows only) -> mori combine (sums the ranks' partial
    rows in-kernel, quantising where MEGA_COMBINE_WIRE asks) -> [T, H]

What the eager path over the same transport does on the host, and what this one does instead:
``bool(valid.all())`` on the ids -> torch ops with fixed shapes (experts/aiter/routing.py); an
all-reduce of every rank's status per layer -> each rank records its own bad ids (they run nowhere)
and raises at its next check, peers are never stalled; ``int(total_recv.item())`` -> the count
stays on the device and every kernel after dispatch reads it. mori sizes its buffers by
MEGA_MAX_TOKENS_PER_RANK; the engine's token bound ``max_tokens_across_ranks`` (checked: tokens <=
bound <= MEGA_MAX_TOKENS_PER_RANK) picks the experts' tile config on the host for the most pairs a
step can bring (ep x bound x top-k), instead of on the device. mori exchanges no header, so ranks
passing different bounds are not detected here: nothing but that local choice depends on it.
Not run on AMD hardware.
"""

from __future__ import annotations

import logging

import torch

from ...experts import ExpertPairs
from ...experts.aiter.routing import rank_major_ids
from ...experts.live import LiveRows
from ...formats.mx import MXTensor
from ...plan.token_bound import bound_problem
from ...transport import PeerInputError, get_transport
from ...transport.mori import live_local_slots
from ...transport.registry import make_transport
from .base import capturing
from .device import WorkspaceForward

logger = logging.getLogger("megamoe")


class MoriForward(WorkspaceForward):
    name = "device mori"

    def __init__(self, layer, group, transport=None) -> None:
        """``transport``: a MoriTransport the caller built (tests); else the cached one for this shape."""
        from ..device.rocm_workspace import MoriWorkspace

        plan, device = layer.plan, layer.device
        self.transport = transport or get_transport(plan.layout_key(), group, device,
                                                    lambda: make_transport(plan, group, device))
        t = self.transport
        super().__init__(layer, group, lambda: MoriWorkspace(plan, device, t.wire, t.recv_capacity))
        why = next((r for r in plan.backends.reasons if r.startswith("aiter fused MegaMoE not used")), None)
        if why and not self.workspace.logged_why:  # once per shape: the upstream engines would run it fused
            self.workspace.logged_why = True
            logger.warning("[megamoe] %s; running the mori device forward with the %s experts", why, plan.backends.provider)

    def __call__(self, x, topk_ids, topk_weights, output_scale, out, max_tokens_across_ranks):
        """mori's collective has no timeout, so this rank always takes part before it raises: a shape
        or bound problem (known on the host) sends no tokens, and what earlier steps recorded in the
        status word is raised after this step's exchange, never before it (a peer would wait forever)."""
        plan = self.plan
        status, message = self.shape_status(x, topk_ids, topk_weights)
        if not status and (message := bound_problem(x.shape[0], max_tokens_across_ranks, plan.mtpr)):
            status = 4
        if status:
            empty = torch.zeros(0, plan.hidden, dtype=torch.bfloat16, device=self.device)
            self._step(empty, torch.zeros(0, plan.topk, dtype=torch.int64, device=self.device),
                       torch.zeros(0, plan.topk, dtype=torch.float32, device=self.device), 1.0, None, None)
            raise PeerInputError(f"[megamoe] {self.layer_name}: {message}; this rank took part with no tokens, no peer "
                                 "waits on it")
        self.check_shapes(x, topk_ids, topk_weights)
        y = self._step(x, topk_ids, topk_weights, output_scale, out, max_tokens_across_ranks)
        if not capturing(self.device):
            self.raise_if_bad_input()
        return y

    def _step(self, x, topk_ids, topk_weights, output_scale: float, out, bound: int | None):
        from ...experts.triton.quant import encode_wire_rows
        from ..device.id_check import record_bad_ids, record_nonfinite_rows
        from ..device.live_pair_sum import live_pair_sum
        from ..device.status import NONFINITE_INPUT

        plan, ws, tr = self.plan, self.workspace, self.transport
        t, k, hidden, w = x.shape[0], plan.topk, plan.hidden, tr.wire
        out = self.output(t, out)
        word, index = ws.status.word, self.status_index
        record_bad_ids(topk_ids, plan.placement.num_physical, word, index)
        ids, weights = rank_major_ids(topk_ids, topk_weights, self.owner, self.slot, tr.experts_per_rank)
        if w.scale_dim:  # quantised once on the sender, payload and E8M0 row side by side
            rows = encode_wire_rows(x.contiguous(), w.dispatch_wire, out=ws.token_rows[:t],
                                    status=(word, NONFINITE_INPUT, index))
            payload = rows[:, : w.payload_bytes].contiguous().view(w.data_type)
            scales = rows[:, w.payload_bytes:].contiguous()
        else:
            payload, scales = x.to(torch.bfloat16).contiguous(), None
        recv, recv_w, recv_s, recv_i, total = tr.op.dispatch(payload, weights, scales, ids)
        ws.live.copy_(total.reshape(-1)[:1])
        self._received_pairs(recv_i, recv_w)
        if w.scale_dim:
            a = MXTensor(data=recv.view(torch.uint8), scales=recv_s.view(torch.uint8), fmt=w.dispatch_wire)
        else:
            a = recv.view(torch.bfloat16)
        n = ws.recv_capacity * k
        pairs = ExpertPairs(row=ws.pair_row, slot=ws.pair_slot, weight=ws.pair_weight, per_row=k)
        most = None if bound is None else min(plan.ep_size * int(bound), ws.recv_capacity) * k
        rows_out = self.provider.forward_wire(a, pairs, self.weights, plan.math, ws.combine_format, out=ws.combine_rows,
                                              live=LiveRows(ws.live, ws.recv_capacity, config_pairs=most),
                                              scratch=ws.scratch)
        live_pair_sum(rows_out[:n], ws.pair_slot, ws.live, ws.partial, k)
        combined, _ = tr.op.combine(ws.partial, None, ids)
        if output_scale != 1.0:
            out.copy_((combined[:t].float() * output_scale).to(torch.bfloat16))
        else:
            out.copy_(combined[:t])
        record_nonfinite_rows(out, word, index)
        ws.status.publish()
        return out

    def _received_pairs(self, recv_ids: torch.Tensor, recv_weights: torch.Tensor) -> None:
        """Local slot and weight of every received pair, into the workspace (-1 past mori's count)."""
        ws, tr = self.workspace, self.transport
        slots, weights = live_local_slots(recv_ids, recv_weights, ws.live, tr.rank, tr.experts_per_rank)
        ws.pair_slot.copy_(slots.reshape(-1).to(torch.int64))
        ws.pair_weight.copy_(weights.reshape(-1))
