"""The ROCm forwards' workspaces: the status word of aiter's fused runtime, and the mori device
forward's fixed buffers (layer/forwards/mori.py), shared by every layer of one shape like the CUDA
ones (workspace.py, through the documented cache in transport/cache.py).

  FusedWorkspace   status only: aiter's runtime owns every buffer of its step
  MoriWorkspace    token_rows   uint8 [MTPR, wire row]   the sender's rows, quantised once (quantised wires)
                   recv_rows    uint8 [R, wire row]      mori's received rows, payload | scales (R = mori's
                                                         receive capacity, ep x MTPR)
                   pair_row     int64 [R * k]            constant: received pair q reads received row q // k
                   pair_slot    int64 [R * k]            local slot of each received pair, -1 = not here / dead
                   pair_weight  fp32  [R * k]            its route weight
                   combine_rows uint8 [R * k, bf16 row]  the experts' bf16 rows, one per pair (mori quantises
                                                         its own combine)
                   partial      bf16  [R, H]             each received row's sum over its local pairs
                   live         int64 [1]                rows mori received this step (its total_recv)
"""

from __future__ import annotations

import torch

from ...formats import combine_wire
from ...plan import LayerPlan
from .workspace import _Workspace


class FusedWorkspace(_Workspace):
    def __init__(self, plan: LayerPlan, device: torch.device) -> None:
        super().__init__(plan, device)
        self.status = self._make_status(plan, rank=plan.ep_rank)


class MoriWorkspace(_Workspace):
    def __init__(self, plan: LayerPlan, device: torch.device, wire, recv_capacity: int) -> None:
        super().__init__(plan, device)
        k, h, dev = self.topk, self.hidden, self.device
        self.recv_capacity = recv_capacity
        quantised = wire.scale_dim > 0
        self.token_rows = torch.empty(self.mtpr if quantised else 0, wire.row_bytes, dtype=torch.uint8, device=dev)
        self.recv_rows = torch.empty(recv_capacity, wire.row_bytes, dtype=torch.uint8, device=dev)
        pairs = recv_capacity * k
        self.pair_row = torch.arange(pairs, dtype=torch.int64, device=dev) // k
        self.pair_slot = torch.full((pairs,), -1, dtype=torch.int64, device=dev)
        self.pair_weight = torch.zeros(pairs, dtype=torch.float32, device=dev)
        self.combine_format = combine_wire("bf16")
        self.combine_rows = torch.empty(pairs, self.combine_format.row_bytes(h), dtype=torch.uint8, device=dev)
        self.partial = torch.zeros(recv_capacity, h, dtype=torch.bfloat16, device=dev)
        self.live = torch.zeros(1, dtype=torch.int64, device=dev)
        self.status = self._make_status(plan, rank=plan.ep_rank)
        self.logged_why = False  # why the fused runtime does not run, logged once per shape

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.token_rows, self.recv_rows, self.pair_row, self.pair_slot,
                                                          self.pair_weight, self.combine_rows, self.partial)) + self.scratch.bytes
