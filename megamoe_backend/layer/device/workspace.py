"""The device workspace: every buffer a sync-free forward needs, sized once, shared by layers.

Why one object: a forward that allocates by the data (``nonzero``, concatenations) cannot run in a
CUDA graph and pays allocator work in every layer. The sizes here come from the plan alone, the
most a forward can carry: MEGA_MAX_TOKENS_PER_RANK tokens x top-k pairs (ep_size 1), with rows as
wide as the wires. All layers of one shape use the same workspace (through the documented cache in
transport/cache.py), one after the other on the stream, so 61 layers cost one set of buffers.

  token_rows   uint8 [MTPR, A row]            the tokens in the A operand's MX format, quantised once
                                              (the dispatch wire's rows; empty for bf16 activations)
  pair_row     int64 [MTPR * k]               constant: pair p = t * k + j reads token row t
  pair_slot    int64 [MTPR * k]               local expert slot of each pair, -1 = does not run here
  pair_weight  fp32  [MTPR * k]               its route weight (0 where slot is -1)
  combine_rows uint8 [MTPR * k, combine row]  what GEMM2's epilogue writes, one row per pair
  status       InputStatus                    data checks reported without a host sync
"""

from __future__ import annotations

import torch

from ...formats import dispatch_wire
from ...plan import LayerPlan
from .status import InputStatus


class DeviceWorkspace:
    def __init__(self, plan: LayerPlan, device: torch.device) -> None:
        self.device = torch.device(device)
        self.mtpr, self.topk, self.hidden = plan.mtpr, plan.topk, plan.hidden
        pairs = self.mtpr * self.topk
        self.a_format = plan.math.a_format  # fp8 | fp4 | None; a quantised dispatch wire equals it (plan check)
        a_bytes = dispatch_wire(self.a_format).row_bytes(self.hidden) if self.a_format else 0
        self.token_rows = torch.empty(self.mtpr if a_bytes else 0, a_bytes, dtype=torch.uint8, device=self.device)
        self.pair_row = torch.arange(pairs, dtype=torch.int64, device=self.device) // self.topk
        self.pair_slot = torch.full((pairs,), -1, dtype=torch.int64, device=self.device)
        self.pair_weight = torch.zeros(pairs, dtype=torch.float32, device=self.device)
        self.combine_rows = torch.empty(pairs, plan.combine.row_bytes(self.hidden), dtype=torch.uint8, device=self.device)
        self.status = InputStatus(self.device, plan.placement.num_physical)
        self.layer_names: dict[int, str] = {}

    def register_layer(self, name: str) -> int:
        """A small id for the status word, so an error names the layer that saw the bad input."""
        index = len(self.layer_names)
        self.layer_names[index] = name
        return index

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.token_rows, self.pair_row, self.pair_slot, self.pair_weight, self.combine_rows))
