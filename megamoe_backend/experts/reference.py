"""Torch reference experts: the CPU path and the yardstick for the GPU kernels.

Accumulation is done in float64 and rounded to fp32 per row. Why: fp32 GEMM results on CPU depend
on how many rows are in the batch (blocking changes the summation order), and the bf16 dispatch
wire must give bit-identical results whatever the EP size, i.e. whichever rows share an expert
batch on a rank. float64 products of bf16/MX-representable inputs make each row independent. Block-FP8
(fp32 scales) keeps that: weights and A are fp32 values (e4m3 x fp32 scale, rounded once to fp32), whose
float64 products are exact too.
"""

from __future__ import annotations

import weakref

import torch

from ..formats import GroupFP8Tensor, MXTensor, dequantize_a, fake_quantize_a
from .base import Activations, ExpertMath, ExpertPairs, ExpertsProvider, swiglu
from .weights import ExpertWeights


def activations_in_a_format(a: Activations, math: ExpertMath) -> torch.Tensor:
    """Received rows -> fp32 values exactly as the A operand sees them.

    A quantised wire already carries the A format (no second quantisation); a bf16 wire is
    quantised here, on the receiver, with the same function the sender would have used.
    """
    if isinstance(a, (MXTensor, GroupFP8Tensor)):
        if a.fmt != math.a_format:
            raise ValueError(
                f"received {a.fmt} rows but quant={math.quant} needs A operand {math.a_format or 'bf16'} "
                "(MEGA_DISPATCH_WIRE must match the expert GEMM's A operand)"
            )
        return dequantize_a(a)
    return fake_quantize_a(a.to(torch.float32), math.a_format)


class TorchReferenceExperts(ExpertsProvider):
    name = "torch"

    def __init__(self) -> None:
        # id(weights) -> (weakref to weights, w1 fp64, w2 fp64); the weakref guards against id reuse.
        self._dequant_cache: dict[int, tuple[weakref.ref, torch.Tensor, torch.Tensor]] = {}
        # id(weights) -> weakref, for weights an engine may rewrite in place (EPLB): never cached
        self._movable: dict[int, weakref.ref] = {}

    def weights_become_movable(self, weights: ExpertWeights) -> None:
        """From now on ``weights`` may be rewritten in place at any time (EPLB moves experts through
        engine-side views whose writes nothing here can observe): keep no fp64 copy of them."""
        self._dequant_cache.pop(id(weights), None)
        self._movable[id(weights)] = weakref.ref(weights)

    def _weights64(self, weights: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
        movable = self._movable.get(id(weights))
        hit = None if movable is not None and movable() is weights else self._dequant_cache.get(id(weights))
        if hit is None or hit[0]() is not weights:
            w1, w2 = weights.dequantized()
            # stored transposed ([E, K, N]) so each expert GEMM is a plain contiguous x @ w
            hit = (weakref.ref(weights), w1.double().transpose(1, 2).contiguous(), w2.double().transpose(1, 2).contiguous())
            if movable is None or movable() is not weights:
                self._dequant_cache[id(weights)] = hit
        return hit[1], hit[2]

    def forward(self, a: Activations, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath) -> torch.Tensor:
        hidden = weights.hidden
        out = torch.zeros(len(pairs), hidden, dtype=torch.float32, device=pairs.weight.device)
        if len(pairs) == 0:
            return out
        x = activations_in_a_format(a, math)
        w1, w2 = self._weights64(weights)
        for slot in torch.unique(pairs.slot).tolist():
            sel = torch.nonzero(pairs.slot == slot).squeeze(1)
            rows = x[pairs.row[sel]].double()
            h = (rows @ w1[slot]).float()
            act = swiglu(h, weights.gate_up_layout, math.swiglu_limit)
            act = fake_quantize_a(act, math.a_format).double()
            y = (act @ w2[slot]).float()
            out[sel] = y * pairs.weight[sel].unsqueeze(1)
        return out
