"""TritonExperts with the frag8 GEMMs run by the sm_90a CUDA kernels (gemms.py): research code.

Why here and not in the package: the kernels are correct (bit for bit the Triton GEMMs at DSV4-Pro
shapes) but were measured slower than the Triton GEMMs in every bucket (docs/triton.md, "The sm_90a
CUDA GEMMs"), so the provider's ``auto`` never picked them and they left megamoe_backend
(MEGA_EXPERTS_GEMM=cuda is refused, naming this folder). Everything but the two GEMM launches is the
provider's own forward (checks, layout, A conversion, frag8's A2 re-scale): this class replaces its
three GEMM steps (``_launch_plan``, ``_gemm1``, ``_gemm2``). Where the kernels cannot run it raises;
nothing falls back, so a run with this provider ran the CUDA GEMMs.

    PYTHONPATH=.:benchmarks/research python3 -m pytest benchmarks/research/cuda_gemms -q   # sm_90 GPU
"""

from __future__ import annotations

import torch

from megamoe_backend.experts.live import LiveRows
from megamoe_backend.experts.triton.config import TileConfig, interpreting
from megamoe_backend.experts.triton.launch_plan import ALL_COUNTS, LaunchPlan, rescale_programs
from megamoe_backend.experts.triton.launches import dest_args
from megamoe_backend.experts.triton.provider import TritonExperts
from megamoe_backend.experts.weights import ExpertWeights

from .gemms import Sm90Frag8Gemms, shapes_supported

# The tile config of a forward on the CUDA GEMMs: only block_m (128-row layout tiles, no short tiles)
# and the K step reach the kernels; the weight tile is theirs (256 rows).
CUDA_CONFIG = TileConfig(block_m=128, block_n1=256, block_n2=256, block_k=128, num_warps=4, num_stages=4)


def why_not(mode: str, device: torch.device, hidden: int, inter: int, live: LiveRows | None) -> str | None:
    """Why the CUDA GEMMs cannot run this forward, or None."""
    if mode != "frag8":
        return f"for decoder {mode!r} (they read frag8 weights: prepare_weights with MX activations)"
    if device.type != "cuda" or interpreting():
        return "under the Triton interpreter" if interpreting() else f"without a CUDA device ({device})"
    if not shapes_supported(hidden, inter):
        return f"at hidden={hidden} / intermediate={inter} (not whole 256-row weight tiles and 128-wide K steps)"
    if live is not None and live.config_pairs is None:
        return "for live rows without a token bound (that forward runs persistent Triton grids)"
    return None


class CudaFrag8Experts(TritonExperts):
    """The Triton provider's forward with GEMM1 and GEMM2 on the sm_90a CUDA kernels (frag8 only)."""

    gemm_kernels = "sm_90a CUDA"  # what ran the GEMMs (benchmarks label their rows with it)

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity=capacity, decoder="frag8")
        self.kernels: Sm90Frag8Gemms | None = None

    def _launch_plan(self, mode: str, pairs: int, weights: ExpertWeights, live: LiveRows | None,
                     device: torch.device) -> LaunchPlan:
        why = why_not(mode, device, weights.hidden, weights.intermediate, live)
        got = Sm90Frag8Gemms.for_device(device) if why is None else why
        if isinstance(got, str):
            raise RuntimeError(f"the sm_90a CUDA expert GEMMs cannot run {got}")
        self.kernels = got
        return LaunchPlan(((CUDA_CONFIG, ALL_COUNTS),), persist=False,
                          rescale_programs=rescale_programs(device, live))

    def _gemm1(self, fl, layout, cfg, a, a2, a2_scale) -> None:
        w = fl.weights
        self.kernels.gemm1(layout, a.data, a.row_scale, w.w1, w.w1_scale, w.w1_row_scale, a2, a2_scale, w.hidden,
                           w.intermediate, fl.a_fmt, fl.limit)

    def _gemm2(self, fl, layout, cfg, a2, out, out_fmt, dest) -> None:
        w = fl.weights
        dest_mode, dest_ptr, seg_pairs, seg_row_bytes, _ = dest_args(dest, fl.pairs)
        self.kernels.gemm2(layout, a2.data, a2.row_scale, w.w2, w.w2_scale, w.w2_row_scale, fl.pairs.weight, out,
                           out.stride(0) if dest is None else 0, dest_mode, dest_ptr, seg_pairs, seg_row_bytes,
                           w.hidden, w.intermediate, out_fmt)
