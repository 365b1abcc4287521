"""Expert-sorted, tile-padded row layout, built on the device with no host synchronisation.

Why: the grouped GEMMs walk rows expert by expert in tiles of BLOCK_M rows; each tile belongs to
exactly one expert. Every size here is static (derived from the pair count P, the number of local
experts E and BLOCK_M), never from the routing values, so building the layout and running both GEMMs
can be captured in a CUDA graph. Tiles beyond the routed ones carry expert -1 and exit at once.

Sizes: a non-empty tile holds >= 1 pair and each expert wastes < 1 tile, so the number of tiles is
at most min(P, ceil(P / BLOCK_M) + E); rows = tiles * BLOCK_M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import interpreting


@dataclass(frozen=True)
class ExpertLayout:
    """Routing metadata for the grouped GEMMs (all int32 device tensors)."""

    block_m: int
    num_tiles: int  # static upper bound on non-empty tiles (grid size along M)
    tile_expert: torch.Tensor  # [num_tiles] local expert of each tile, -1 for unused tiles
    sorted_pair: torch.Tensor  # [num_tiles * block_m] pair index of each sorted row, -1 for padding
    sorted_row: torch.Tensor  # [num_tiles * block_m] that pair's received row (GEMM1's A row), -1 for padding
    live_tiles: torch.Tensor | None = None  # [1] the tiles the GEMMs walk (persistent grids); None: all num_tiles

    @property
    def num_rows(self) -> int:
        return self.num_tiles * self.block_m


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    return max(1, min(num_pairs, -(-num_pairs // block_m) + num_experts))


LAYOUT_BLOCK_MS = (16, 32, 64, 128)  # the tile heights of the config tables (config.py)


def capacity_reserve(capacity: int, num_experts: int, block_m: int = 0) -> tuple[int, int, int]:
    """(pairs, tiles, rows) a layout of at most ``capacity`` pairs can need at any tile height of the
    config tables (or ``block_m``): what experts/scratch.py reserves, so no later forward outgrows it."""
    heights = LAYOUT_BLOCK_MS + ((block_m,) if block_m else ())
    return (capacity, max(max_tiles(capacity, num_experts, b) for b in heights),
            max(max_tiles(capacity, num_experts, b) * b for b in heights))


def build_layout(
    slot: torch.Tensor, num_experts: int, block_m: int, capacity: int | None = None, row: torch.Tensor | None = None,
    live=None, active: tuple[int, int] = (-1, 2**31 - 1), all_tiles: bool = True, scratch=None, pdl: bool = False,
) -> ExpertLayout:
    """Sort pairs by local expert, padding each expert's rows to a multiple of ``block_m``.

    ``row``: each pair's received row (pairs.row; default: the pair index), laid out beside the
    pairs as ``sorted_row``, so GEMM1 finds a tile's A rows with one load instead of two dependent ones.

    ``capacity`` is the most pairs this layout may ever hold (MTPR-derived); more pairs raise
    instead of being dropped. Slots lie in [0, num_experts), or are -1 for a pair that does not run
    here (the device forward keeps every (token, k) entry in place: masked ids, experts of other
    ranks); such a pair gets no row. Other values are checked only on CPU tensors, where the check
    costs no device synchronisation (the GPU kernels give any out-of-range slot no row). On CUDA (and under the Triton interpreter) three
    small Triton launches build it (`layout_kernels.py`); otherwise torch ops do (`build_layout_torch`,
    also the tests' reference). Both keep the pairs' order within an expert, so they agree exactly.

    ``live`` (experts/live.py LiveRows, Triton build only): read and place only the live pairs (the
    rest of the region is stale); ``layout.live_tiles`` then holds the routed tile count on the
    device, 0 when the live pair count falls outside ``active`` = (lo, hi] (another tile config runs);
    ``all_tiles`` False leaves the tiles past live_tiles unwritten (persistent GEMMs never read them).

    ``scratch`` (experts/scratch.py, Triton build only): the layout's buffers come from it, reserved
    for ``capacity`` pairs (else this call's), so a forward allocates nothing once it has run.

    ``pdl`` (Triton build only): launched with programmatic dependent launch (pdl.py), as the
    experts forward launches its other kernels.
    """
    if slot.dim() != 1:
        raise ValueError(f"pairs.slot must be 1-D [P], got shape {tuple(slot.shape)}")
    p = slot.shape[0]
    if capacity is not None and p > capacity:
        raise ValueError(
            f"{p} routed pairs exceed the experts capacity of {capacity} pairs "
            "(MEGA_MAX_TOKENS_PER_RANK x top-k x ep_size); raise MEGA_MAX_TOKENS_PER_RANK, rows are never dropped"
        )
    if slot.device.type == "cpu" and p and (int(slot.min()) < -1 or int(slot.max()) >= num_experts):
        raise ValueError(f"pairs.slot out of range [0, {num_experts}) (or -1: not here): "
                         f"min {int(slot.min())}, max {int(slot.max())}")
    if row is None:
        row = torch.arange(p, dtype=torch.int32, device=slot.device)
    elif tuple(row.shape) != (p,):
        raise ValueError(f"pairs.row must be [P] = [{p}] like pairs.slot, got shape {tuple(row.shape)}")
    if slot.device.type == "cuda" or interpreting():
        from .layout_kernels import build_layout_triton

        n_tiles = max_tiles(p, num_experts, block_m)
        reserve = capacity_reserve(capacity if capacity is not None else p, num_experts, block_m)
        tile_expert, sorted_pair, sorted_row, live_tiles = build_layout_triton(slot, row, num_experts, block_m, n_tiles,
                                                                               live, active, all_tiles, scratch, reserve, pdl)
        return ExpertLayout(block_m=block_m, num_tiles=n_tiles, tile_expert=tile_expert, sorted_pair=sorted_pair,
                            sorted_row=sorted_row, live_tiles=live_tiles)
    if live is not None:
        raise ValueError("live rows (LiveRows) need the Triton layout build (CUDA or TRITON_INTERPRET=1)")
    return build_layout_torch(slot, num_experts, block_m, row)


def build_layout_torch(slot: torch.Tensor, num_experts: int, block_m: int, row: torch.Tensor | None = None) -> ExpertLayout:
    """The same layout from torch ops (about a dozen launches; the reference for the Triton build)."""
    p = slot.shape[0]
    row = torch.arange(p, device=slot.device) if row is None else row
    dev = slot.device
    n_tiles = max_tiles(p, num_experts, block_m)
    slot = slot.to(torch.int64)
    placed = slot >= 0  # -1: the pair does not run here and gets no row
    slot = torch.where(placed, slot, num_experts)  # a spare bin past the real experts, sorted last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).index_add_(0, slot, torch.ones_like(slot))[:num_experts]
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_expert, 0)
    tile_start = tile_end - tiles_per_expert
    tile_ids = torch.arange(n_tiles, dtype=torch.int64, device=dev)
    tile_expert = torch.searchsorted(tile_end, tile_ids, right=True)
    tile_expert = torch.where(tile_expert >= num_experts, -1, tile_expert)

    order = torch.sort(slot, stable=True).indices
    order = order[: int(placed.sum())]
    sorted_slot = slot[order]
    row_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.shape[0], dtype=torch.int64, device=dev) - row_start[sorted_slot]
    dest = tile_start[sorted_slot] * block_m + rank
    sorted_pair = torch.full((n_tiles * block_m,), -1, dtype=torch.int32, device=dev)
    sorted_pair.index_copy_(0, dest, order.to(torch.int32))
    sorted_row = torch.full_like(sorted_pair, -1)
    sorted_row.index_copy_(0, dest, row[order].to(torch.int32))
    return ExpertLayout(block_m=block_m, num_tiles=n_tiles, tile_expert=tile_expert.to(torch.int32), sorted_pair=sorted_pair,
                        sorted_row=sorted_row)
