"""The expert-sorted layout (layout.py) built by three Triton launches instead of ~12 torch ops.

Why: at decode sizes the torch build (histogram, cumsums, searchsorted, a stable radix sort,
scatters) cost ~50-60 µs of launches on an H200, a tenth of a whole experts forward at 8 tokens per
rank. Same result, bit for bit: the pairs of an expert keep their order (a stable counting sort).

1. ``_chunk_histogram``: pairs in chunks of CH; each program counts the local experts of its span
   of chunks (a contiguous run, ``_chunk_span``) into one histogram row, and fills its share of
   ``sorted_pair`` / ``sorted_row`` with -1 (padding until _scatter places a pair).
2. ``_plan`` (one program): per expert the pairs of earlier spans (exclusive prefix over the
   programs' rows), the expert's tiles and first row, the expert of every tile (a binary search of
   each tile in the experts' tile ends). One program is a serial chain of loads on one SM, so it
   does only what needs the whole histogram: the -1 fill (288 of its steps at 8192 tokens x top-6 on
   192 experts) and a second pass adding first rows to the chunk bases used to be here (H200 at 8192
   tokens: 55-63 -> 36-45 us), and the tile map compared every tile with every expert ([32, E] per
   step; with the search and 64-chunk steps, H200 profiler kernel times: 44 -> 23 us at 8192 tokens,
   14 -> 5 us at 1024, benchmarks/results/h200_rows_ab.json). Its prefix walks one row per program,
   not per chunk (issue 48): an EP rank's region holds all k slots of every token of every source,
   ~3,000 chunks at EP 8 x 8192 tokens, and a row per chunk made this scan 115 us on an H100 (12 us
   now, 17 at ep_size 1; benchmarks/results/h100_layout_spans_ab.json).
3. ``_scatter``: each program walks the span it counted; a pair's row = its expert's first row +
   pairs of that expert in earlier spans and earlier chunks of its own span (a running histogram) +
   earlier pairs of that expert in its own chunk; it stores the pair and its received row there.
   Spans are contiguous and in program order, so an expert's pairs keep their order.
Every size comes from P, E and BLOCK_M only (no host synchronisation; CUDA-graph capturable). Over
live rows (experts/live.py) steps 1 and 3 run a fixed grid (LIVE_CHUNK_PROGRAMS) whose spans cover
only the chunks holding live pairs, and the -1 fill covers only the rows those pairs can reach;
over all pairs they run one program per chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import interpreting
from .pdl import pdl_args, pdl_enter

CHUNK = 128  # pairs per chunk: the in-chunk rank is a CHUNK x CHUNK comparison
# programs of the chunk kernels over live rows (experts/live.py): one wave of an H200's 132 SMs twice over;
# without it a region sized by capacity launched one program per chunk of the region (EP 8 at
# MEGA_MAX_TOKENS_PER_RANK 8192: 3,072 programs, 15 us per _scatter for a decode step; issue 32)
LIVE_CHUNK_PROGRAMS = 264


@triton.jit
def live_pairs_total(counts_ptr, n_seg, seg_rows, per_row, N_SEG: tl.constexpr):
    """(live pairs of each segment [N_SEG], their total): segment s's first counts[s] rows (clamped
    to [0, seg_rows]: a peer's bad header can cost rows, never an access outside the region)."""
    s_idx = tl.arange(0, N_SEG)
    c = tl.load(counts_ptr + s_idx, mask=s_idx < n_seg, other=0)
    c = tl.minimum(tl.maximum(c, 0), seg_rows).to(tl.int32) * per_row
    return c, tl.sum(c, 0)


@triton.jit
def live_to_index(i, c, seg_len, N_SEG: tl.constexpr):
    """Live index i (0 .. total-1, segments' live heads laid end to end) -> the index in the region
    (segment s at s * seg_len); ``c``: live entries of each segment (live_pairs_total)."""
    s_idx = tl.arange(0, N_SEG)
    incl = tl.cumsum(c, 0)
    seg = tl.sum((incl[None, :] <= i[:, None]).to(tl.int32), 1)
    before = tl.sum(tl.where(s_idx[None, :] < seg[:, None], c[None, :], 0), 1)
    return seg.to(tl.int64) * seg_len + (i - before)


@triton.jit
def _chunk_slots(chunk, slot_ptr, P, E, counts_ptr, n_seg, seg_rows, per_row,
                 E_PAD: tl.constexpr, CH: tl.constexpr, SEG: tl.constexpr, N_SEG: tl.constexpr):
    """Chunk ``chunk``'s pair indices and slots; past the pairs, and any slot outside [0, E), read as the
    spare last bin E_PAD - 1, which no tile uses (the layer validates slots first; this only keeps a
    bad slot from indexing out of bounds: such a pair gets no row). SEG: chunks walk the live pairs
    only (LiveRows), mapped to their index in the region."""
    i = chunk * CH + tl.arange(0, CH)
    if SEG:
        c, total = live_pairs_total(counts_ptr, n_seg, seg_rows, per_row, N_SEG)
        live = i < total
        q = live_to_index(i, c, seg_rows * per_row, N_SEG)
    else:
        live = i < P
        q = i.to(tl.int64)
    s = tl.load(slot_ptr + q, mask=live, other=E_PAD - 1).to(tl.int32)
    return q, tl.where((s >= 0) & (s < E), s, E_PAD - 1)


@triton.jit
def _chunk_span(n_chunks):
    """The chunks this program owns: a contiguous span [first, end) of cdiv(n_chunks, programs). The
    histogram and scatter launches run the same grid, so a program scatters the chunks it counted,
    and every earlier program's chunks hold earlier pairs (what keeps the sort stable)."""
    per = tl.cdiv(n_chunks, tl.num_programs(0))
    first = tl.program_id(0) * per
    return first, tl.minimum(first + per, n_chunks)


@triton.jit
def _chunk_histogram(slot_ptr, P, E, hist_ptr, sorted_pair_ptr, sorted_row_ptr, rows, rows_per_program,
                     counts_ptr, n_seg, seg_rows, per_row, BM, num_tiles,
                     E_PAD: tl.constexpr, CH: tl.constexpr, FB: tl.constexpr, SEG: tl.constexpr, N_SEG: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_enter(PDL)
    if SEG:  # a fixed grid over the chunks holding live pairs, and only the rows they can fill:
        # ceil(live / BM) + E tiles at most (a region sized by capacity costs its live pairs)
        seg_live, total = live_pairs_total(counts_ptr, n_seg, seg_rows, per_row, N_SEG)
        n_chunks = tl.cdiv(total, CH)
        rows = tl.minimum(num_tiles, (total + BM - 1) // BM + E) * BM
        rows_per_program = tl.cdiv(rows, tl.num_programs(0))
    else:  # one program per chunk of the pairs
        n_chunks = tl.cdiv(P, CH)
    # one histogram row per program: its span's pairs of each expert (zeros for an empty span)
    first, end = _chunk_span(n_chunks)
    h = tl.zeros([E_PAD], dtype=tl.int32)
    for chunk in range(first, end):
        _, s = _chunk_slots(chunk, slot_ptr, P, E, counts_ptr, n_seg, seg_rows, per_row, E_PAD, CH, SEG, N_SEG)
        h += tl.histogram(s, E_PAD)
    tl.store(hist_ptr + tl.program_id(0) * E_PAD + tl.arange(0, E_PAD), h)
    first = tl.program_id(0) * rows_per_program
    end = tl.minimum(first + rows_per_program, rows)
    for r0 in range(first, end, FB):
        r = r0 + tl.arange(0, FB)
        tl.store(sorted_pair_ptr + r, tl.full([FB], -1, tl.int32), mask=r < end)
        tl.store(sorted_row_ptr + r, tl.full([FB], -1, tl.int32), mask=r < end)


@triton.jit
def _plan(
    hist_ptr, base_ptr, first_row_ptr, tile_end_ptr, NC, E, BM, num_tiles, tile_expert_ptr, live_tiles_ptr,
    active_lo, active_hi, E_PAD: tl.constexpr, CB: tl.constexpr, TB: tl.constexpr, LOG_E: tl.constexpr,
    ALL_TILES: tl.constexpr = True, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    e = tl.arange(0, E_PAD)
    real = e < E
    # pass 1 over the NC histogram rows (one per chunk-kernel program, _chunk_histogram): base[c, e] =
    # pairs of expert e in the spans of programs < c; counts = all of them
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
    # the tiles the GEMMs walk (their persistent grids read it): all routed tiles, or none when this
    # layout's tile config is not the one the live pair count picks (TritonExperts: device-side choice)
    n_pairs = tl.sum(counts, 0)
    live_tiles = tl.where((n_pairs > active_lo) & (n_pairs <= active_hi), tl.max(tile_end, 0), 0)
    tl.store(live_tiles_ptr, live_tiles)
    tl.debug_barrier()  # tile_end is read back below by other threads of this program
    if not ALL_TILES:  # persistent GEMMs stop at live_tiles: the tiles past it are never read
        num_tiles = live_tiles
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
             counts_ptr, n_seg, seg_rows, per_row, live_tiles_ptr,
             E_PAD: tl.constexpr, CH: tl.constexpr, SEG: tl.constexpr, N_SEG: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    if SEG:  # the chunks holding live pairs, each program its _chunk_histogram span
        if tl.load(live_tiles_ptr) > 0:  # else nothing to place (no live pair, or another config runs)
            seg_live, total = live_pairs_total(counts_ptr, n_seg, seg_rows, per_row, N_SEG)
            _scatter_span(tl.cdiv(total, CH), slot_ptr, row_ptr, P, E, base_ptr, first_row_ptr, sorted_pair_ptr,
                          sorted_row_ptr, counts_ptr, n_seg, seg_rows, per_row, E_PAD, CH, SEG, N_SEG)
    else:
        _scatter_span(tl.cdiv(P, CH), slot_ptr, row_ptr, P, E, base_ptr, first_row_ptr, sorted_pair_ptr,
                      sorted_row_ptr, counts_ptr, n_seg, seg_rows, per_row, E_PAD, CH, SEG, N_SEG)


@triton.jit
def _scatter_span(n_chunks, slot_ptr, row_ptr, P, E, base_ptr, first_row_ptr, sorted_pair_ptr, sorted_row_ptr,
                  counts_ptr, n_seg, seg_rows, per_row,
                  E_PAD: tl.constexpr, CH: tl.constexpr, SEG: tl.constexpr, N_SEG: tl.constexpr):
    """Places the pairs of this program's span, chunk by chunk. ``run`` [E_PAD] holds, per expert, the
    pairs before the chunk (earlier programs' spans from _plan, then this span's earlier chunks); each
    chunk's pairs read it through this program's row of ``base_ptr`` (a gather by expert), rewritten
    before the chunk and read by every thread before the next rewrite (the barriers)."""
    e = tl.arange(0, E_PAD)
    base_row = base_ptr + tl.program_id(0) * E_PAD
    run = tl.load(base_row + e)
    first, end = _chunk_span(n_chunks)
    j = tl.arange(0, CH)
    for chunk in range(first, end):
        tl.store(base_row + e, run)
        tl.debug_barrier()
        i, s = _chunk_slots(chunk, slot_ptr, P, E, counts_ptr, n_seg, seg_rows, per_row, E_PAD, CH, SEG, N_SEG)
        placed = s < E
        earlier = (s[:, None] == s[None, :]) & (j[None, :] < j[:, None])
        rank = tl.sum(earlier.to(tl.int32), 1)
        row = tl.load(base_row + s, mask=placed, other=0) + rank
        row += tl.load(first_row_ptr + s, mask=placed, other=0)
        tl.store(sorted_pair_ptr + row, i.to(tl.int32), mask=placed)
        tl.store(sorted_row_ptr + row, tl.load(row_ptr + i, mask=placed, other=0).to(tl.int32), mask=placed)
        run += tl.histogram(s, E_PAD)
        tl.debug_barrier()


def live_rows_args(live) -> dict:
    """The keyword arguments of a kernel that walks the live received rows of ``live`` (LiveRows) with
    live_pairs_total / live_to_index: live_ptr, n_seg, seg_rows, PERSIST and N_SEG."""
    return dict(live_ptr=live.counts, n_seg=live.segments, seg_rows=live.seg_rows, PERSIST=True,
                N_SEG=triton.next_power_of_2(live.segments))


def build_layout_triton(
    slot: torch.Tensor, row: torch.Tensor, num_experts: int, block_m: int, num_tiles: int, live=None,
    active: tuple[int, int] = (-1, 2**31 - 1), all_tiles: bool = True, scratch=None, reserve: tuple[int, int, int] = (0, 0, 0),
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tile_expert [num_tiles], sorted_pair, sorted_row [num_tiles * block_m]) int32, as build_layout_torch,
    and live_tiles (int32 [1]: the tiles the GEMMs walk).

    ``live`` (experts/live.py LiveRows): only the live pairs are read, placed and counted; the tiles
    past live_tiles are left unwritten (every consumer stops at live_tiles). ``active`` (lo, hi]: the
    live pair counts this layout's tile config serves; outside it live_tiles is 0 (another runs).
    ``all_tiles`` False: tile_expert is written up to live_tiles only (for persistent GEMMs, which stop
    there), else for all num_tiles (-1 past the routed ones: one program per tile may be launched).

    ``scratch`` (experts/scratch.py): the buffers come from it, ``reserve`` = (pairs, tiles, rows) at
    capacity, so they are allocated once; None: fresh tensors. ``pdl``: the three launches use
    programmatic dependent launch (pdl.py; the experts forward's ForwardLaunch.pdl)."""
    from ..scratch import scratch_empty

    p = slot.shape[0]
    dev = slot.device
    e_pad = triton.next_power_of_2(num_experts + 1)  # + a spare bin for the masked tail of a chunk
    nc = max(1, triton.cdiv(p, CHUNK))
    cap_chunks = max(1, triton.cdiv(reserve[0], CHUNK))
    i32 = torch.int32

    def buf(name, shape, cap=0):
        return scratch_empty(scratch, "layout." + name, shape, i32, dev, cap)

    # live rows: the chunk kernels run a fixed grid that walks the chunks holding live pairs (a region
    # of 65,536 rows x top-6 is 3,072 chunks, of which a decode step fills a few)
    grid = nc if live is None else min(nc, 3 if interpreting() else LIVE_CHUNK_PROGRAMS)
    hist = buf("hist", (grid, e_pad), cap_chunks * e_pad)  # one row per chunk-kernel program (its span)
    base = buf("base", (grid, e_pad), cap_chunks * e_pad)
    first_row, tile_end = buf("first_row", (e_pad,)), buf("tile_end", (e_pad,))
    tile_expert = buf("tile_expert", (num_tiles,), reserve[1])
    sorted_pair = buf("sorted_pair", (num_tiles * block_m,), reserve[2])
    sorted_row = buf("sorted_row", (num_tiles * block_m,), reserve[2])
    live_tiles = buf("live_tiles", (1,))
    slot, row = slot.contiguous(), row.contiguous()
    rows = num_tiles * block_m
    if live is None:
        seg = dict(counts_ptr=live_tiles, n_seg=1, seg_rows=0, per_row=1, SEG=False, N_SEG=1)
    else:
        n_recv = live.segments * live.seg_rows
        seg = dict(counts_ptr=live.counts, n_seg=live.segments, seg_rows=live.seg_rows, per_row=p // n_recv, SEG=True,
                   N_SEG=triton.next_power_of_2(live.segments))
    _chunk_histogram[(grid,)](slot, p, num_experts, hist, sorted_pair, sorted_row, rows, triton.cdiv(rows, grid),
                            BM=block_m, num_tiles=num_tiles, E_PAD=e_pad, CH=CHUNK, FB=1024, **seg, **pdl_args(pdl))
    _plan[(1,)](hist, base, first_row, tile_end, grid, num_experts, block_m, num_tiles, tile_expert, live_tiles,
                active_lo=active[0], active_hi=active[1], E_PAD=e_pad, CB=max(1, min(64, 16384 // e_pad)), TB=1024,
                LOG_E=e_pad.bit_length(), ALL_TILES=all_tiles, num_warps=8, **pdl_args(pdl))
    _scatter[(grid,)](slot, row, p, num_experts, base, first_row, sorted_pair, sorted_row, live_tiles_ptr=live_tiles,
                    E_PAD=e_pad, CH=CHUNK, **seg, **pdl_args(pdl))
    return tile_expert, sorted_pair, sorted_row, live_tiles
