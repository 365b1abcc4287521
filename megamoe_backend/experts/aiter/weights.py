"""One layer's MXFP4 expert weights in the layout aiter's fused MegaMoE runtimes read.

Why aiter's own helpers: the kernels read a lane-shuffled layout that aiter defines and may
change; re-implementing the permutation would drift silently. We only bring the weights to the
layout those helpers take as input: gate/up *plain* (GGUU, [g0..g_{I-1}, u0..u_{I-1}]) rows,
MXFP4 bytes (first element in the low nibble, as aiter/mori/our formats all store it), E8M0 scales.

- gfx950 / MegaMoEV2 (op_tests/multigpu_tests/test_mega_moe_v2.py, ROCm/aiter e4048607):
  ``shuffle_weight_a16w4(w1, 16, True)``, ``shuffle_scale_a16w4(w1_scale_2d, E, True)``,
  ``shuffle_weight_a16w4(w2, 16, False)``, ``shuffle_scale_a16w4(w2_scale_2d, E, False)``;
  the scales are passed 2-D, [E * rows, K // 32]. gate_up=True interleaves gate/up itself.
- gfx1250 / MegaMoEGfx1250 (aiter/ops/shuffle.py, same commit): ``moe_shuffle_weight`` /
  ``moe_shuffle_scale`` with ``is_guinterleave=True, gate_up=True`` for w1 (they interleave the
  GGUU rows into GUGU, as the fused stage2 needs gate_mode=INTERLEAVE), plain for w2. The shuffled
  weights are then *viewed* as ``torch.float4_e2m1fn_x2`` (aiter's ``dtypes.fp4x2``): aiter's
  fused_moe reads the weight format from ``w1.dtype``, and its grouped gfx1250 kernel -- the one
  that writes the fused combine's stage-2 scatter -- takes fp4 activations (A4W4) only for
  ``w1.dtype == fp4x2`` (aiter grouped_moe_gfx1250.py:991) and fp8 activations (A8W4) for fp4x2 or
  uint8; MegaMoEGfx1250.forward accepts both ("requires MXFP4 w1/w2 weights (uint8 or fp4x2)").
  On uint8 an A4W4 step would take fused_moe's generic path and the combine would sum a buffer
  nothing wrote. ATOM serves ``wire=fp4 force_a8w4=0`` fused the same way (its fp4 weights are
  fp4x2 parameters).
Not run on AMD hardware.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from ..weights import ExpertWeights, deinterleave_gate_up

SHUFFLE_MODULE = "aiter.ops.shuffle"
FP4X2 = torch.float4_e2m1fn_x2  # aiter dtypes.fp4x2: two e2m1 per byte, what MegaMoEGfx1250's A4W4 needs
V2_NLANE = 16  # shuffle_weight_a16w4(src, NLane=16, gate_up) as in aiter's MegaMoEV2 test and ATOM


@dataclass(frozen=True)
class AiterLayerWeights:
    """Shuffled tensors for one layer; ``runtime`` says which aiter class they were prepared for."""

    runtime: str  # "MegaMoEV2" | "MegaMoEGfx1250"
    w1: torch.Tensor
    w1_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    num_experts: int


def plain_mxfp4(weights: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1, w1_scale, w2, w2_scale) with GGUU gate/up rows, contiguous uint8."""
    if weights.fmt != "mxfp4":
        raise ValueError(
            f"aiter's fused MegaMoE runtimes take MXFP4 expert weights (a8w4 / a4w4); got fmt={weights.fmt!r}"
        )
    w1, s1 = weights.w1, weights.w1_scale
    if weights.gate_up_layout == "interleaved":
        w1, s1 = deinterleave_gate_up(w1), deinterleave_gate_up(s1)
    return w1.contiguous(), s1.contiguous(), weights.w2.contiguous(), weights.w2_scale.contiguous()


def prepare_v2_weights(weights: ExpertWeights, shuffle: Any = None) -> AiterLayerWeights:
    shuffle = shuffle or importlib.import_module(SHUFFLE_MODULE)
    w1, s1, w2, s2 = plain_mxfp4(weights)
    e = w1.shape[0]
    return AiterLayerWeights(
        runtime="MegaMoEV2",
        w1=shuffle.shuffle_weight_a16w4(w1, V2_NLANE, True).contiguous(),
        w1_scale=shuffle.shuffle_scale_a16w4(s1.reshape(e * s1.shape[1], s1.shape[2]), e, True).contiguous(),
        w2=shuffle.shuffle_weight_a16w4(w2, V2_NLANE, False).contiguous(),
        w2_scale=shuffle.shuffle_scale_a16w4(s2.reshape(e * s2.shape[1], s2.shape[2]), e, False).contiguous(),
        num_experts=e,
    )


def prepare_gfx1250_weights(weights: ExpertWeights, shuffle: Any = None) -> AiterLayerWeights:
    shuffle = shuffle or importlib.import_module(SHUFFLE_MODULE)
    w1, s1, w2, s2 = plain_mxfp4(weights)
    e = w1.shape[0]
    return AiterLayerWeights(
        runtime="MegaMoEGfx1250",
        w1=shuffle.moe_shuffle_weight(w1, experts_cnt=e, is_guinterleave=True, gate_up=True).contiguous().view(FP4X2),
        w1_scale=shuffle.moe_shuffle_scale(s1, experts_cnt=e, is_guinterleave=True, gate_up=True).contiguous(),
        w2=shuffle.moe_shuffle_weight(w2, experts_cnt=e).contiguous().view(FP4X2),
        w2_scale=shuffle.moe_shuffle_scale(s2, experts_cnt=e).contiguous(),
        num_experts=e,
    )


PREPARERS = {"MegaMoEV2": prepare_v2_weights, "MegaMoEGfx1250": prepare_gfx1250_weights}
