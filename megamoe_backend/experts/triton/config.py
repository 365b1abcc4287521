"""Tile shapes per token bucket (data, not branches inside the kernels).

The choice depends on the average rows per local expert (P / E): decode-sized buckets are
weight-streaming (small token tile, wide weight tile, deep K), prefill-sized ones are MMA-bound
(large square tiles). Defaults come from the H200 sweep recorded in docs/triton.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # token rows per tile (MMA N side, swap-AB)
    block_n1: int  # GEMM1 output rows (gate/up interleaved) per tile; >= 64 (two 32-blocks of A2)
    block_n2: int  # GEMM2 output columns per tile
    block_k: int  # reduction step (upper bound; shrunk to divide K)
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 4
    tail_m: int = 0  # > 0: a tile whose rows from tail_m on are padding runs at height tail_m (mainloop.claim_tile)
    max_registers: int = 0  # > 0: ptxas register cap per thread (Triton's maxnreg), e.g. 168 = 3 CTAs of 4 warps per SM
    tail_ride: bool = False  # with tail_m: a short tile after a full one of its expert rides in that tile's K loop (frag decoders)
    tail_max_registers: int = 0  # > 0: the short-tile launch's own register cap (else max_registers), e.g. 128 = 4 CTAs per SM; moot without tail_m

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n1", "block_n2", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{name}={v} must be a power of two >= 16")
        if self.block_n1 < 64:
            raise ValueError(f"TileConfig.block_n1={self.block_n1} must be >= 64 (A2 is quantised in 1x32 blocks)")
        if self.block_k < 32:
            raise ValueError(f"TileConfig.block_k={self.block_k} must be >= 32 (one E8M0 block)")
        t = self.tail_m
        if t and (t < 16 or t & (t - 1) or t >= self.block_m):
            raise ValueError(f"TileConfig.tail_m={t} must be 0 (off) or a power of two in [16, block_m={self.block_m})")
        if self.tail_ride and not t:
            raise ValueError("TileConfig.tail_ride needs tail_m > 0 (the rider's height)")
        for name in ("max_registers", "tail_max_registers"):
            r = getattr(self, name)
            if r and (r % 8 or not 24 <= r <= 255):
                raise ValueError(f"TileConfig.{name}={r} must be 0 (compiler's choice) or a multiple of 8 in [24, 255]")

    def launch_registers(self, tile_pass: str, persistent: bool = False) -> int:
        """ptxas register cap of one launch (0: the compiler's choice). The short-tile launch holds a
        smaller accumulator than the full one, so it gets its own cap: a cap sized for the full tile
        (3 CTAs per SM) leaves the short one a few registers above the 4-CTA line. A persistent launch
        (the EP forward without a bound) runs a fixed grid whatever the pass (launch_plan.persistent_grid) and its
        tile loop needs registers of its own: capped it spilled (frag8 mid short pass: 1056 bytes at 128,
        136 at 168; tests/kernels/test_sass.py), so it runs uncapped."""
        if persistent:
            return 0
        if tile_pass == "short" and self.tail_max_registers:
            return self.tail_max_registers
        return self.max_registers

    def with_(self, **kw) -> "TileConfig":
        return replace(self, **kw)


def reduction_block(k: int, want: int) -> int:
    """Largest power of two <= want that divides k (k % 32 == 0, so at least 32)."""
    bk = want
    while bk > 32 and k % bk:
        bk //= 2
    return bk


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# (max average rows per expert, config); first match wins. Row-major weights (split / dot_scaled).
BUCKETS: tuple[tuple[float, TileConfig], ...] = (
    (12.0, TileConfig(block_m=16, block_n1=128, block_n2=128, block_k=128, num_warps=4, num_stages=3)),
    (48.0, TileConfig(block_m=64, block_n1=128, block_n2=128, block_k=128, num_warps=8, num_stages=3)),
    (float("inf"), TileConfig(block_m=128, block_n1=128, block_n2=128, block_k=128, num_warps=4, num_stages=3)),
)
# Fragment-ordered weights (frag decoder); H200 sweeps in docs/triton.md. At decode sizes the kernels
# are instruction-issue bound (ncu: ~73 % issue slots busy at 128 tokens), so from ~1 row per expert
# on the tile is 256 weight rows x 64 K: four m64 wgmmas share each k16 step's descriptor / arrive /
# wait (2.9 instructions per weight instead of 3.0) at 126 registers. A handful of tokens over all
# experts (T = 8) keeps BN 128 (twice the programs: better tail). Mid sizes: BM 64, one tile per
# expert at ~32 rows (BM 32 decodes each weight tile twice for a third of the experts).
FRAG_BUCKETS: tuple[tuple[float, TileConfig], ...] = (
    (1.0, TileConfig(block_m=16, block_n1=128, block_n2=128, block_k=128, num_warps=4, num_stages=3)),
    (16.0, TileConfig(block_m=16, block_n1=256, block_n2=256, block_k=64, num_warps=4, num_stages=4)),
    (48.0, TileConfig(block_m=64, block_n1=256, block_n2=256, block_k=64, num_warps=4, num_stages=4)),
    (float("inf"), TileConfig(block_m=128, block_n1=128, block_n2=128, block_k=128, num_warps=4, num_stages=3)),
)
# FP8-MMA fragments (frag8, the default for A8W4 / A4W4): one chained K loop like frag, K steps of 128
# (four k32 wgmmas per m64 slab; the weights' K order needs exactly 128). H200 interleaved A/B
# (docs/triton.md): BN 128 at decode sizes (BN 256 within 1 %); at mid sizes BM 64 (one tile per expert)
# x BN 128 capped at 168 registers, so three CTAs share an SM (the latency-bound loop wants warps:
# -7 % against BN 256 at 255 registers and two CTAs; at DSV4-Pro shapes with W_FULL ptxas fits 168
# uncapped, 170 before: the cap guards other shapes and toolchains); BM 128 x BN 128 for prefill. tail_m:
# an expert's last tile runs at that height, in a second launch, when its rows end before it
# (mainloop.claim_tile): 1024 tokens -4 % with 32, 8192 tokens -4..-8 % with 16 (3 interleaved rounds each,
# benchmarks/results/h200_tail_ab.json; 32 / 64 at prefill measured slower: a short tile's cost is
# mostly the weight decode, which does not shrink with its height). tail_ride at prefill: a short
# tile after a full one of its expert runs in that tile's K loop on the same decoded weights
# (8192 tokens: faster in 6 of 8 interleaved sustained rounds, median -1.75 %, benchmarks/results/h200_ride_ab.json).
# tail_max_registers 128 at mid sizes: the short launch needs 130 registers since the K steps retire their
# wgmmas (mainloop._retire), one CTA per SM fewer; at 128 it has no spill and four again (1024 tokens: kernel
# sums 1894-1897 -> 1874-1877 us, isolated replays 1897-1899 -> 1878-1880 us, benchmarks/results/h200_regcap_ab.json).
# The decode tile ends at 13 rows per expert, not 16: at 16 (48 experts x 128 tokens, 192 x 512) about 40 %
# of the experts hold more than 16 rows, so BM 16 streams and decodes their weights twice (1.4-1.5 tiles per
# expert hit); the mid tile runs them once (its 32-row short tiles). H200, sustained replays, 3 interleaved
# rounds (benchmarks/results/h200_decode_edge_ab.json): 16 rows 572-584 -> 500-505 us (48 x 128) and 2234 ->
# 1875-1920 us (192 x 512); 14 rows 521 -> 491-493 (48 x 112), 1940-1951 -> 1880-1918 (192 x 448); at 12 rows
# the decode tile is still 3-5 % faster (48 x 96: 468-470 against 483-490). A BM 32 row of its own would gain
# 3-5 % more at 16 rows but adds a candidate config to every forward over live rows without a bound.
FRAG8_BUCKETS: tuple[tuple[float, TileConfig], ...] = (
    (13.0, TileConfig(block_m=16, block_n1=128, block_n2=128, block_k=128, num_warps=4, num_stages=4)),
    (48.0, TileConfig(block_m=64, block_n1=128, block_n2=128, block_k=128, num_warps=4, num_stages=4, tail_m=32,
                      max_registers=168, tail_max_registers=128)),
    (float("inf"), TileConfig(block_m=128, block_n1=128, block_n2=128, block_k=128, num_warps=4, num_stages=3, tail_m=16,
                              tail_ride=True)),
)
# Block-FP8 (decoder "block_fp8": e4m3 weights in 128 x 128 blocks, A in 1 x 128 groups). The scales change every
# 128 of K, so block_k is 128 (one weight block and one A group per K step, scales applied per step as vLLM's
# Triton fused_moe does); block_n1 256 = 128 gate + 128 up rows, so GEMM1's epilogue holds whole 1 x 128 groups
# of A2 (GEMM1's epilogue). Each K step's MMA result is a second accumulator-sized tensor beside the accumulator (it
# is scaled before it is added), so the tiles keep both near 128 registers a thread: decode BM 16, mid BM 32 (4 warps),
# prefill BM 64 (8 warps). Prefill's GEMM2 takes BN 256 (a sweep on an H100, 32 DeepSeek V3 experts,
# benchmarks/research/block_fp8_tiles.py -> benchmarks/results/h100_block_fp8_tiles.json: 8192 tokens 12474 -> 11281 µs,
# 1024 tokens 1794 -> 1634 µs; BM 128 spills, 2.5-2.7x slower; BM 256 or BN1 512 exceed shared memory).
BLOCK_FP8_BUCKETS: tuple[tuple[float, TileConfig], ...] = (
    (13.0, TileConfig(block_m=16, block_n1=256, block_n2=128, block_k=128, num_warps=4, num_stages=4)),
    (48.0, TileConfig(block_m=32, block_n1=256, block_n2=128, block_k=128, num_warps=4, num_stages=3)),
    (float("inf"), TileConfig(block_m=64, block_n1=256, block_n2=256, block_k=128, num_warps=8, num_stages=3)),
)
BLOCK_FP8_GROUP = 128  # the A group / weight block edge every block_fp8 tile config must step by
# block_k 128 is shrunk to divide K (reduction_block), so it is also frag8's fixed K step where K allows
INTERPRETER_CONFIG = TileConfig(block_m=16, block_n1=64, block_n2=32, block_k=128, num_warps=4, num_stages=1, group_m=2)
INTERPRETER_BLOCK_FP8 = TileConfig(block_m=16, block_n1=256, block_n2=64, block_k=128, num_warps=4, num_stages=1, group_m=2)


def default_config(num_pairs: int, num_experts: int, decoder: str = "split") -> TileConfig:
    if interpreting():
        return INTERPRETER_BLOCK_FP8 if decoder == "block_fp8" else INTERPRETER_CONFIG
    return _table(decoder)[bucket_index(num_pairs, num_experts, decoder)][1]


def _table(decoder: str) -> tuple[tuple[float, TileConfig], ...]:
    return {"frag": FRAG_BUCKETS, "frag8": FRAG8_BUCKETS, "block_fp8": BLOCK_FP8_BUCKETS}.get(decoder, BUCKETS)


def bucket_index(num_pairs: int, num_experts: int, decoder: str = "split") -> int:
    """Which row of the decoder's bucket table a batch falls in (by average rows per expert)."""
    table = _table(decoder)
    avg = num_pairs / max(1, num_experts)
    for i, (limit, _) in enumerate(table):
        if avg <= limit:
            return i
    return len(table) - 1


def bucket_class(num_pairs: int, num_experts: int) -> str:
    """decode (weight streaming), mid or prefill (MMA-bound): the frag8 table's rows, by average rows per expert."""
    return ("decode", "mid", "prefill")[bucket_index(num_pairs, num_experts, "frag8")]
