"""The device forward at ep_size 1 (CUDA, Triton experts): four stages on fixed buffers — sender
quantisation, route kernel (ids -> pairs + id check), the experts writing the combine wire rows,
the top-k sum — with no host synchronisation and nothing sized by the data, so it is captured in
CUDA graphs. Data checks report through the workspace's status word (layer/device/status.py)."""

from __future__ import annotations

import logging

import torch

from ...experts import ExpertPairs
from ...transport import PeerTimeoutError
from ...transport.cache import get_workspace
from .base import LayerForward, capturing

logger = logging.getLogger("megamoe")


class WorkspaceForward(LayerForward):
    """A device forward on a workspace shared by every layer of the shape (transport/cache.py):
    registers this layer's name for the status word and raises what the word recorded."""

    def __init__(self, layer, group, factory) -> None:
        super().__init__(layer.plan, layer.device, layer.name)
        self.provider, self.weights = layer.provider, layer.weights
        self.owner, self.slot = layer.owner, layer.slot
        plan = self.plan
        if plan.combine.mx not in (None, "fp8"):
            raise ValueError(f"the device forward's top-k sum reads bf16 or fp8_blockwise_1x32 rows, not {plan.combine.name}")
        self.workspace, is_new = get_workspace(plan.layout_key(), group, self.device, factory)
        self.status_index = self.workspace.register_layer(self.layer_name)
        if is_new:
            logger.info(plan.startup_line(self.name, experts=getattr(self.provider, "name", None)))  # fused: no provider

    def raise_if_bad_input(self) -> None:
        """Raise what the device checks recorded in earlier forwards (finished on the GPU) and clear it.
        A peer that timed out (P2P forward) leaves the workspace broken: every later forward of this
        shape raises the same error at once."""
        ws = self.workspace
        if ws.broken:
            raise PeerTimeoutError(ws.broken)
        try:
            ws.status.raise_if_bad(ws.layer_names)
        except PeerTimeoutError as exc:
            ws.broken = str(exc)
            raise

    def begin(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Host-side start of every forward: shapes, then (eager only) what earlier forwards recorded."""
        self.check_shapes(x, topk_ids, topk_weights)
        if not capturing(self.device):
            self.raise_if_bad_input()


class DeviceForward(WorkspaceForward):
    name = "device"

    def __init__(self, layer) -> None:
        from ..device.workspace import DeviceWorkspace

        super().__init__(layer, None, lambda: DeviceWorkspace(layer.plan, layer.device))

    def __call__(self, x, topk_ids, topk_weights, output_scale, out, max_tokens_across_ranks):
        from ...experts.triton.quant import encode_wire_rows
        from ...formats.wire import a_format_wire
        from ..device.route import route_pairs
        from ..device.status import NONFINITE_INPUT
        from ..device.topk_sum import topk_sum

        plan, ws = self.plan, self.workspace
        self.begin(x, topk_ids, topk_weights)
        t, k, hidden = x.shape[0], plan.topk, plan.hidden
        out = self.output(t, out)
        if t == 0:
            return out
        n = t * k
        pair_slot, pair_weight = ws.pair_slot[:n], ws.pair_weight[:n]
        route_pairs(topk_ids, topk_weights, self.owner, self.slot, plan.ep_rank, pair_slot, pair_weight,
                    ws.status.word, self.status_index)
        a_fmt = ws.a_format
        if a_fmt is None:
            rows_a = x.to(torch.bfloat16).contiguous()  # bf16 activations: the rows as they are
        else:
            # one quantisation per token into the A format (= the quantised dispatch wire; with the bf16
            # wire at ep_size 1 it is the receiver's quantisation, the same bits), reporting NaN / Inf rows;
            # a row that routes nowhere (all ids -1: an engine's padded row) is skipped, as the P2P dispatch does
            rows = encode_wire_rows(x.contiguous(), a_fmt, out=ws.token_rows[:t],
                                    status=(ws.status.word, NONFINITE_INPUT, self.status_index),
                                    routed_ids=topk_ids.contiguous())
            rows_a = a_format_wire(a_fmt).view(rows, hidden)
        pairs = ExpertPairs(row=ws.pair_row[:n], slot=pair_slot, weight=pair_weight, per_row=k)
        wire_rows = self.provider.forward_wire(rows_a, pairs, self.weights, plan.math, plan.combine, out=ws.combine_rows[:n],
                                             scratch=ws.scratch)
        topk_sum(wire_rows, pair_slot, out, plan.combine.mx, hidden, k, ws.status.word, self.status_index, output_scale)
        ws.status.publish()
        return out
