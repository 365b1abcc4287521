"""The references every bench figure's relL2 is measured against, and the samples they use.

Why one module: the project's experts (per pair), its layer and the peers beside it (per token: a fused
MoE call returns one route-weighted sum per token) must be checked against the SAME reference for their
relL2 to compare: the project's fp32 reference MoE (layer/reference.py: fp32 math on the dequantised
weights, unquantised activations), fed per pair or per token here. The benches (bench_experts,
bench_layer, bench_layer_emulated) import it, it imports no bench.
"""

from __future__ import annotations

import torch

from megamoe_backend.experts import ExpertMath, ExpertPairs, ExpertWeights, swiglu
from megamoe_backend.formats import MXTensor, dequantize_mx, fake_quantize_a
from megamoe_backend.formats.block_fp8 import dequantize_weight_blocks
from megamoe_backend.layer.reference import fp32_reference_moe


def subset_reference(x, pairs: ExpertPairs, sel: torch.Tensor, wd: ExpertWeights, math: ExpertMath, exact: bool) -> torch.Tensor:
    """Outputs of the pairs ``sel``. exact=False: the fp32 reference MoE with each pair as a token of its
    own (top-1); exact=True: the kernels' math (A / A2 quantised, fp64 GEMMs), the bit-level yardstick."""
    rows, slots, weight = x[pairs.row[sel]].float(), pairs.slot[sel], pairs.weight[sel]
    if not exact:
        return fp32_reference_moe(rows, slots[:, None], weight[:, None], wd.w1, wd.w2, wd.gate_up_layout,
                                  math.swiglu_limit)
    rows = fake_quantize_a(rows, math.a_format)
    out = torch.empty(sel.numel(), wd.hidden, dtype=torch.float32, device=x.device)
    for e in torch.unique(slots).tolist():
        idx = torch.nonzero(slots == e).squeeze(1)
        h = (rows[idx].double() @ wd.w1[e].double().T).float()
        act = fake_quantize_a(swiglu(h, wd.gate_up_layout, math.swiglu_limit), math.a_format)
        out[idx] = (act.double() @ wd.w2[e].double().T).float() * weight[idx, None]
    return out


def check_subset(pairs: ExpertPairs, limit: int, seed: int, n_experts: int = 8) -> torch.Tensor:
    """Pairs of a few random experts (<= limit): the fp64 references then touch few weight matrices."""
    g = torch.Generator().manual_seed(seed)
    slot = pairs.slot.cpu()
    chosen = torch.unique(slot[torch.randperm(slot.numel(), generator=g)[:n_experts]])
    sel = torch.nonzero(torch.isin(slot, chosen)).squeeze(1)[:limit]
    return sel.to(pairs.slot.device)


class LocalExperts:
    """W1 or W2 (``which``) of each local expert of ``wd`` in fp32, made when indexed: bf16 weights widened,
    MXFP4 ones dequantised (the same values: an e2m1 code times a power of two is exact in bf16), block-FP8
    ones dequantised per 128 x 128 block, so a
    reference needs no dequantised copy of all experts (``bench layer --emulate`` keeps one only for rank 0)."""

    def __init__(self, wd: ExpertWeights, which: str) -> None:
        self.wd, self.which = (wd if wd.fmt == "bf16" else wd.as_rowmajor()), which

    def __getitem__(self, e: int) -> torch.Tensor:
        w = getattr(self.wd, self.which)[e]
        if self.wd.fmt == "bf16":
            return w.float()
        scale = getattr(self.wd, f"{self.which}_scale")[e]
        if self.wd.fmt == "fp8_block":  # e4m3 values x one fp32 scale per 128 x 128 block
            return dequantize_weight_blocks(w, scale)
        return dequantize_mx(MXTensor(w, scale, "fp4"))


def token_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, wd: ExpertWeights,
                    limit: float | None, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 rows [len(tokens), H] of the route-weighted sum over each token's pairs (the fp32 reference
    MoE), what a fused MoE call (a peer, the layer) returns per token. ``ids`` [T, k] are local expert
    ids of ``wd``; -1 marks a pair on another rank (skipped: the partial sum an EP rank returns)."""
    return fp32_reference_moe(x[tokens], ids[tokens], weights[tokens], LocalExperts(wd, "w1"), LocalExperts(wd, "w2"),
                              wd.gate_up_layout, limit)


def check_tokens(n_tokens: int, limit: int, seed: int, device: torch.device) -> torch.Tensor:
    """Up to ``limit`` random token indices of ``n_tokens`` (sorted): the tokens a per-token relL2 reads."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n_tokens, generator=g)[:limit].sort().values.to(device)
