"""What one forward of the Triton experts launches: its tile configs, grids and passes (config choice).

Facts in (pair count, live rows, decoder, device), a ``LaunchPlan`` out; the launches themselves are
launches.py's, the buffers forward_buffers.py's. One place per decision: the provider asks
``plan_launches`` and nothing else re-derives a config, a grid or a pass.

The measured grid thresholds are one ``GridPolicy``; research probes pass plan_launches another
through a provider of their own (benchmarks/research/emulated_kernel_spans.py: bounded_grid_ab.py,
persistent_grid_ab.py), never by rebinding module globals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..live import LiveRows
from .config import TileConfig, _table, default_config, interpreting
from .layout import max_tiles

ALL_COUNTS = (-1, 2**31 - 1)  # (lo, hi]: a layout that serves every live pair count
WHOLE_REGION = 2**31 - 1  # a grid cap that never binds: one program per tile of the region


@dataclass(frozen=True)
class GridPolicy:
    """When a bounded forward's GEMMs run persistent grids, and how large a persistent GEMM grid is.

    The defaults are the H200 measurements (``persistent_gemms``): persistent grids from prefill
    tiles (``bounded_persist_block_m`` rows and up) whose region holds ``bounded_persist_ratio`` x the
    tiles the bound's pairs fill. ``gemm_waves`` scales the persistent GEMM grid (about one resident
    wave, ``persistent_grid``); ``inf``: one program per tile of the region (the grid of a probe that
    prices the empty programs)."""

    bounded_persist_block_m: int = 128
    bounded_persist_ratio: float = 4.0
    gemm_waves: float = 1.0

    def __post_init__(self) -> None:
        if self.bounded_persist_block_m < 0 or not self.bounded_persist_ratio >= 0 or not self.gemm_waves > 0:
            raise ValueError(f"GridPolicy{(self.bounded_persist_block_m, self.bounded_persist_ratio, self.gemm_waves)}: "
                             "block_m and ratio must be >= 0, gemm_waves > 0")


DEFAULT_GRIDS = GridPolicy()


@dataclass(frozen=True)
class LaunchPlan:
    """The launches of one forward: each tile config with the live pair counts (lo, hi] it serves,
    whether the GEMMs run persistent grids, and frag8's row re-scales' grid cap (None: one program per row)."""

    candidates: tuple[tuple[TileConfig, tuple[int, int]], ...]
    persist: bool
    rescale_programs: int | None
    grids: GridPolicy = DEFAULT_GRIDS

    def gemm_programs(self, device: torch.device, cfg: TileConfig) -> int | None:
        """The GEMM grid cap for ``cfg``: a persistent grid, or None (one program per tile)."""
        return persistent_grid(device, cfg, self.grids.gemm_waves) if self.persist else None


def plan_launches(config: TileConfig | None, pairs: int, num_experts: int, mode: str, live: LiveRows | None,
                  device: torch.device, grids: GridPolicy = DEFAULT_GRIDS) -> LaunchPlan:
    """The tile configs (a fixed ``config``, else per bucket), grids and re-scale cap of a forward
    of ``pairs`` pairs in decoder ``mode``, over ``live`` rows or all of them."""
    if live is not None:
        candidates = tile_candidates(config, pairs // live.segments, num_experts, mode, live.config_pairs)
    else:
        candidates = ((config or default_config(pairs, num_experts, mode), ALL_COUNTS),)
    persist = persistent_gemms(live, pairs, num_experts, candidates[0][0].block_m, grids)
    return LaunchPlan(candidates, persist, rescale_programs(device, live), grids)


def rescale_programs(device: torch.device, live: LiveRows | None) -> int | None:
    """The grid of frag8's row re-scales: over live rows a fixed grid of RESCALE_PROGRAMS_PER_SM programs per
    SM walks them; over all rows None (one program per row). Every forward that re-scales asks here."""
    return persistent_grid(device, per_sm=RESCALE_PROGRAMS_PER_SM) if live is not None else None


def tile_candidates(config: TileConfig | None, seg_pairs: int, num_experts: int, mode: str,
                    config_pairs: int | None) -> tuple[tuple[TileConfig, tuple[int, int]], ...]:
    """The tile configs of a forward over live rows, each with the live pair counts (lo, hi] it serves.

    A bound (``config_pairs``, the engine's DP-padded batch x top-k) or a fixed config gives one. With
    no bound the host knows only the region (``seg_pairs``: one source's share, what a rank receives
    when every rank fills its region), so one per bucket up to the region's runs: the smallest (decode) for up to
    its limit of pairs per expert, the next buckets' over theirs, up to the region's; each layout finds on the device
    whether the live count is its own (build_layout ``active``), the others' GEMMs exit at once."""
    if config is not None:
        return ((config, ALL_COUNTS),)
    if config_pairs is not None:
        return ((default_config(config_pairs, num_experts, mode), ALL_COUNTS),)
    table = _table(mode)
    avg = seg_pairs / max(1, num_experts)
    last = next((i for i, (limit, _) in enumerate(table) if avg <= limit), len(table) - 1)
    out, lo = [], ALL_COUNTS[0]
    for i in range(last + 1):  # every bucket up to the region's, each over its own live pair range
        hi = ALL_COUNTS[1] if i == last else int(table[i][0] * num_experts)
        cfg = default_config(max(lo, 0) + 1 if i else 0, num_experts, mode)
        if out and out[-1][0] == cfg:
            out[-1] = (cfg, (out[-1][1][0], hi))
        else:
            out.append((cfg, (lo, hi)))
        lo = hi
    return tuple(out)


def persistent_gemms(live: LiveRows | None, region_pairs: int, num_experts: int, block_m: int,
                     grids: GridPolicy = DEFAULT_GRIDS) -> bool:
    """Whether the GEMMs run persistent grids over the live tiles the layout counted (mainloop.persistent_items)
    instead of one program per tile of the region.

    Without live rows the pairs are the work: one program per tile, as at ep_size 1. Live rows without
    a bound: the region is the capacity (MTPR), so always persistent. With a bound the region still
    holds ep x bound rows, because any source may send all its tokens to this rank, while a step fills
    about bound x top-k pairs, so one program per tile launches mostly programs with no tile where the
    region dwarfs that. Measured on the H200 (one emulated step per rank, A8W4, uniform routing,
    benchmarks/results/h200_bounded_grid_ab.json; persistent / tile grid): EP 8 prefill tiles (BM 128)
    at 5.7x / 7.2x the bound's tiles 0.98 / 0.95 (2048 / 8192 tokens: the tile grid's GEMM2 +12 / +18 %),
    at 3.3x 1.03; decode tiles at 1.5-4.5x 0.98-1.02; EP 2 (1.2-2x) 1.00-1.08. The persistent loop has
    a cost of its own (GEMM1 +10 % at EP 2 / 8192; its prefill kernels spill more), which only a large share of
    empty programs repays: hence ``grids.bounded_persist_block_m`` 128 and ``bounded_persist_ratio`` 4."""
    if live is None:
        return False
    if live.config_pairs is None:
        return True
    worst, expected = max_tiles(region_pairs, num_experts, block_m), max_tiles(live.config_pairs, num_experts, block_m)
    return block_m >= grids.bounded_persist_block_m and worst >= grids.bounded_persist_ratio * expected


_SMS: dict[int, int] = {}  # documented cache: multiprocessor count per CUDA device index
# Programs per SM of frag8's row re-scales (rowscale_e4m3) over live rows: 2 warps and <= 40 registers each, one row
# in flight per program, so 24 (25 fit by registers) keep more loads in flight. The EP 8 rank's two re-scales at
# 8192 tokens: 613 us at 8 per SM, 443 at 24, 438 at 64, where the same rows at ep_size 1 (one program per row) take
# 276 (H100, 2026-12-06, benchmarks/research/ep_experts_vs_ep1.py, benchmarks/results/h100_pdl_rescale_ab.json).
RESCALE_PROGRAMS_PER_SM = 24


def persistent_grid(device: torch.device, cfg: TileConfig | None = None, waves: float = 1.0, per_sm: int = 8) -> int:
    """Programs of a persistent launch (a fixed grid that loops over the live work): about one resident
    wave, so a launch with nothing live (a tile config the live count did not pick) costs one wave of
    programs that exit. GEMMs (``cfg``): 3 CTAs per SM up to 64-row tiles (frag8 decode / mid configs
    fit 3), 2 for 128-row tiles, times ``waves`` (GridPolicy.gemm_waves; inf: no cap); the row kernels
    (no shared memory): ``per_sm`` per SM (8; frag8's row re-scales RESCALE_PROGRAMS_PER_SM). Under the
    interpreter 3 programs, so its tests stride."""
    if cfg is not None and waves == float("inf"):
        return WHOLE_REGION
    if device.type != "cuda" or interpreting():
        base = 3
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _SMS:
            _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
        base = (per_sm if cfg is None else (3 if cfg.block_m <= 64 else 2)) * _SMS[index]
    return base if cfg is None else max(1, int(base * waves))


def grid(programs: int, cap: int | None) -> int:
    """A launch's grid: ``programs`` (one per row or tile), at most ``cap`` (a persistent grid)."""
    return max(1, programs if cap is None else min(programs, cap))


def tile_passes(cfg: TileConfig, mode: str) -> tuple[str, ...]:
    """The launches of each GEMM (mainloop.claim_tile): with tail_m the short tiles run in a launch
    of their own at height tail_m (compiled apart: one kernel holding both heights was measured
    nondeterministic for A8W4 GEMM1 on the H200, docs/triton.md); with tail_ride the short tiles that
    follow a full tile of their expert ride in that tile's K loop, in a third launch."""
    if not cfg.tail_m:
        return ("full",)
    if not cfg.tail_ride:
        return ("full", "short")
    if mode not in ("frag", "frag8"):
        raise ValueError(f"TileConfig.tail_ride needs a fragment decoder (frag / frag8), not {mode!r}")
    return ("full", "ride", "short")


def whole_weight_tiles(n: int, block_n: int) -> bool:
    """The GEMM's weight tiles all lie inside its N rows (true at DeepSeek shapes), so the K loops load
    them without a row mask (W_FULL, mainloop.frag_mainloop_ride)."""
    return n % block_n == 0


def register_cap(cfg: TileConfig, tile_pass: str, persistent: bool = False) -> dict:
    """Launch option for one tile pass's ptxas register cap (TileConfig.launch_registers), or none."""
    r = cfg.launch_registers(tile_pass, persistent)
    return {"maxnreg": r} if r else {}
