"""aiter experts: MegaMoE layers run by aiter's fused runtimes (MegaMoEV2 on gfx950,
MegaMoEGfx1250 on gfx1250) over mori. Imports aiter/mori lazily; safe to import on CPU.
Not run on AMD hardware (docs/rocm.md)."""

from .fused import AiterFusedMoE
from .heap import MoriHeap, parse_mori_size, v2_shmem_bytes
from .routing import rank_major_ids
from .runtime import AiterRuntimeSpec, cached_runtime_keys, clear_aiter_runtimes
from .weights import AiterLayerWeights, plain_mxfp4, prepare_gfx1250_weights, prepare_v2_weights

__all__ = [
    "AiterFusedMoE",
    "AiterLayerWeights",
    "AiterRuntimeSpec",
    "MoriHeap",
    "cached_runtime_keys",
    "clear_aiter_runtimes",
    "parse_mori_size",
    "plain_mxfp4",
    "prepare_gfx1250_weights",
    "prepare_v2_weights",
    "rank_major_ids",
    "v2_shmem_bytes",
]
