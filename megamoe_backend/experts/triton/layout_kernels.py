"""The expert-sorted layout (layout.py) built by three Triton launches instead of ~12 torch ops.

Why: at decode sizes the torch build (histogram, cumsums, searchsorted, a stable radix sort,
scatters) cost ~50-60 µs of launches on an H200, a tenth of a whole experts forward at 8 tokens per
rank. Same result, bit for bit: the pairs of an expert keep their order (a stable counting sort).

1. ``_chunk_histogram``: pairs in chunks of CH, one histogram of local experts per chunk; each
   program also fills its share of ``sorted_pair`` / ``sorted_row`` with -1 (padding until _scatter
   places a pair).
2. ``_plan`` (one program): per expert the pairs of earlier chunks (exclusive prefix over chunks),
   the expert's tiles and first row, the expert of every tile (a binary search of each tile in the
   experts' tile ends). One program is a serial chain of loads on one SM, so it does only what needs
   the whole histogram: the -1 fill (288 of its steps at 8192 tokens x top-6 on 192 experts) and a
   second pass adding first rows to the chunk bases used to be here (H200 at 8192 tokens: 55-63 ->
   36-45 us), and the tile map compared every tile with every expert ([32, E] per step; with the
   search and 64-chunk steps, H200 profiler kernel times: 44 -> 23 us at 8192 tokens, 14 -> 5 us at
   1024, benchmarks/results/h200_rows_ab.json).
3. ``_scatter``: each pair's row = its expert's first row + pairs of that expert in earlier chunks +
   earlier pairs of that expert in its own chunk; it stores the pair and its received row there.
Every size comes from P, E and BLOCK_M only (no host synchronisation; CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 128  # pairs per chunk: the in-chunk rank is a CHUNK x CHUNK comparison


@triton.jit
def _chunk_slots(slot_ptr, P, E, E_PAD: tl.constexpr, CH: tl.constexpr):
    """This chunk's pair indices and slots; past P, and any slot outside [0, E), read as the spare
    last bin E_PAD - 1, which no tile uses (the layer validates slots first; this only keeps a bad
    slot from indexing out of bounds: such a pair gets no row)."""
    i = tl.program_id(0) * CH + tl.arange(0, CH)
    s = tl.load(slot_ptr + i, mask=i < P, other=E_PAD - 1).to(tl.int32)
    return i, tl.where((s >= 0) & (s < E), s, E_PAD - 1)


@triton.jit
def _chunk_histogram(slot_ptr, P, E, hist_ptr, sorted_pair_ptr, sorted_row_ptr, rows, rows_per_program,
                     E_PAD: tl.constexpr, CH: tl.constexpr, FB: tl.constexpr):
    _, s = _chunk_slots(slot_ptr, P, E, E_PAD, CH)
    tl.store(hist_ptr + tl.program_id(0) * E_PAD + tl.arange(0, E_PAD), tl.histogram(s, E_PAD))
    first = tl.program_id(0) * rows_per_program
    end = tl.minimum(first + rows_per_program, rows)
    for r0 in range(first, end, FB):
        r = r0 + tl.arange(0, FB)
        tl.store(sorted_pair_ptr + r, tl.full([FB], -1, tl.int32), mask=r < end)
        tl.store(sorted_row_ptr + r, tl.full([FB], -1, tl.int32), mask=r < end)


@triton.jit
def _plan(
    hist_ptr, base_ptr, first_row_ptr, tile_end_ptr, NC, E, BM, num_tiles, tile_expert_ptr,
    E_PAD: tl.constexpr, CB: tl.constexpr, TB: tl.constexpr, LOG_E: tl.constexpr,
):
    e = tl.arange(0, E_PAD)
    real = e < E
    # pass 1: base[c, e] = pairs of expert e in chunks < c; counts = all of them
    run = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, NC, CB):
        c = c0 + tl.arange(0, CB)
        off = c[:, None] * E_PAD + e[None, :]
        h = tl.load(hist_ptr + off, mask=(c < NC)[:, None], other=0)
        incl = tl.cumsum(h, 0)
        tl.store(base_ptr + off, run[None, :] + incl - h, mask=(c < NC)[:, None])
        run += tl.sum(h, 0)
    counts = tl.where(real, run, 0)
    tiles = (counts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, 0)
    tl.store(first_row_ptr + e, (tile_end - tiles) * BM)  # _scatter adds it to the chunk bases
    tl.store(tile_end_ptr + e, tile_end)
    tl.debug_barrier()  # tile_end is read back below by other threads of this program
    # the expert of tile t = the number of real experts whose tiles all end at or before t (-1 past
    # the last): an upper-bound binary search over the non-decreasing tile_end[0:E], LOG_E steps
    for t0 in range(0, num_tiles, TB):
        t = t0 + tl.arange(0, TB)
        lo = tl.zeros([TB], dtype=tl.int32)
        hi = tl.zeros([TB], dtype=tl.int32) + E
        for _ in tl.static_range(LOG_E):
            go = lo < hi
            mid = (lo + hi) // 2
            before = tl.load(tile_end_ptr + mid, mask=go, other=0) <= t
            lo = tl.where(go & before, mid + 1, lo)
            hi = tl.where(go & ~before, mid, hi)
        tl.store(tile_expert_ptr + t, tl.where(lo >= E, -1, lo), mask=t < num_tiles)


@triton.jit
def _scatter(slot_ptr, row_ptr, P, E, base_ptr, first_row_ptr, sorted_pair_ptr, sorted_row_ptr,
             E_PAD: tl.constexpr, CH: tl.constexpr):
    i, s = _chunk_slots(slot_ptr, P, E, E_PAD, CH)
    j = tl.arange(0, CH)
    placed = s < E
    earlier = (s[:, None] == s[None, :]) & (j[None, :] < j[:, None])
    rank = tl.sum(earlier.to(tl.int32), 1)
    row = tl.load(base_ptr + tl.program_id(0) * E_PAD + s, mask=placed, other=0) + rank
    row += tl.load(first_row_ptr + s, mask=placed, other=0)
    tl.store(sorted_pair_ptr + row, i, mask=placed)
    tl.store(sorted_row_ptr + row, tl.load(row_ptr + i, mask=placed, other=0).to(tl.int32), mask=placed)


def build_layout_triton(
    slot: torch.Tensor, row: torch.Tensor, num_experts: int, block_m: int, num_tiles: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tile_expert [num_tiles], sorted_pair, sorted_row [num_tiles * block_m]) int32, as build_layout_torch."""
    p = slot.shape[0]
    dev = slot.device
    e_pad = triton.next_power_of_2(num_experts + 1)  # + a spare bin for the masked tail of a chunk
    nc = max(1, triton.cdiv(p, CHUNK))
    hist = torch.empty(nc, e_pad, dtype=torch.int32, device=dev)
    base = torch.empty(nc, e_pad, dtype=torch.int32, device=dev)
    first_row = torch.empty(e_pad, dtype=torch.int32, device=dev)
    tile_end = torch.empty(e_pad, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(num_tiles, dtype=torch.int32, device=dev)
    sorted_pair = torch.empty(num_tiles * block_m, dtype=torch.int32, device=dev)
    sorted_row = torch.empty_like(sorted_pair)
    slot, row = slot.contiguous(), row.contiguous()
    rows = num_tiles * block_m
    _chunk_histogram[(nc,)](slot, p, num_experts, hist, sorted_pair, sorted_row, rows, triton.cdiv(rows, nc),
                            E_PAD=e_pad, CH=CHUNK, FB=1024)
    _plan[(1,)](hist, base, first_row, tile_end, nc, num_experts, block_m, num_tiles, tile_expert,
                E_PAD=e_pad, CB=max(1, min(64, 16384 // e_pad)), TB=1024, LOG_E=e_pad.bit_length(), num_warps=8)
    _scatter[(nc,)](slot, row, p, num_experts, base, first_row, sorted_pair, sorted_row, E_PAD=e_pad, CH=CHUNK)
    return tile_expert, sorted_pair, sorted_row
