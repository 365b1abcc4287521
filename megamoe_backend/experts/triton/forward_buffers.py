"""Where one Triton experts forward's intermediates live (scratch): views of the caller's
ExpertsScratch, each reserved at the size the provider's capacity can need.

Why reserved at capacity: the layer's forwards pass their workspace's scratch, so the first forward
allocates every buffer at its largest and no later forward of any batch size allocates (the hot-path
rule; experts/scratch.py). Without a scratch (the experts alone: benchmarks, tests) each buffer is a
fresh tensor of this call's size.
"""

from __future__ import annotations

from math import prod

import torch

from ..scratch import ExpertsScratch, scratch_counters, scratch_empty
from .layout import capacity_reserve


class ForwardBuffers:
    """The buffers of one forward of ``pairs`` pairs over ``recv_rows`` received rows, for a provider
    of ``capacity`` pairs (None: this call's size). Pairs per received row are fixed (k in the
    layer's forwards), so the received rows at capacity are ``capacity / k``."""

    def __init__(self, scratch: ExpertsScratch | None, device: torch.device, pairs: int, recv_rows: int,
                 capacity: int | None) -> None:
        self.scratch, self.device = scratch, device
        self.pairs_cap = max(pairs, capacity or 0)
        per_row = pairs // recv_rows if pairs and recv_rows else 0  # 0: no pairs to size the rows by
        self.recv_cap = max(recv_rows, self.pairs_cap // per_row) if per_row else recv_rows

    def _take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, rows_cap: int) -> torch.Tensor:
        return scratch_empty(self.scratch, name, shape, dtype, self.device, rows_cap * prod(shape[1:]))

    def per_received_row(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer with one row per received row (the A operand converted once per row)."""
        return self._take(name, shape, dtype, self.recv_cap)

    def per_pair(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer with one row per pair (a provider whose GEMMs index rows by pair: experts/humming/)."""
        return self._take(name, shape, dtype, self.pairs_cap)

    def per_layout_row(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, num_experts: int,
                       block_m: int) -> torch.Tensor:
        """A buffer with one row per expert-sorted layout row (GEMM1's A2); every tile config of a
        forward shares it, so it is reserved at the tallest layout the capacity can need."""
        return self._take(name, shape, dtype, capacity_reserve(self.pairs_cap, num_experts, block_m)[2])

    def gemm_claims(self) -> torch.Tensor:
        """The persistent GEMMs' shared item counter + arrival count (mainloop.persistent_items): one
        pair serves every launch of the forward, each leaves it zero for the next (stream order)."""
        return scratch_counters(self.scratch, "gemm_claims", 2, self.device)
