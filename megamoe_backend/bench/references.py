"""The fp32 / exact references every bench figure's relL2 is measured against, and the samples they use.

Why one module: the project's experts (per pair), its layer and the peers beside it (per token: a fused
MoE call returns one route-weighted sum per token) must be checked against the SAME reference, fp32
math on the dequantised weights with unquantised activations, for their relL2 to compare; the benches
(bench_experts, bench_layer, bench_layer_emulated) import it, it imports no bench.
"""

from __future__ import annotations

import torch

from ..experts import ExpertMath, ExpertPairs, ExpertWeights, swiglu
from ..formats import MXTensor, dequantize_mx, fake_quantize


def subset_reference(x, pairs: ExpertPairs, sel: torch.Tensor, wd: ExpertWeights, math: ExpertMath, exact: bool) -> torch.Tensor:
    """Outputs of the pairs ``sel``. exact=True: the kernels' math (A / A2 quantised, fp64 GEMMs);
    exact=False: fp32 math on the same (dequantised) weights with unquantised activations."""
    dtype = torch.float64 if exact else torch.float32
    rows = x[pairs.row[sel]].float()
    if exact:
        rows = fake_quantize(rows, math.a_format)
    out = torch.empty(sel.numel(), wd.hidden, dtype=torch.float32, device=x.device)
    slots = pairs.slot[sel]
    for e in torch.unique(slots).tolist():
        idx = torch.nonzero(slots == e).squeeze(1)
        h = (rows[idx].to(dtype) @ wd.w1[e].to(dtype).T).float()
        act = swiglu(h, wd.gate_up_layout, math.swiglu_limit)
        if exact:
            act = fake_quantize(act, math.a_format)
        out[idx] = (act.to(dtype) @ wd.w2[e].to(dtype).T).float() * pairs.weight[sel][idx, None]
    return out


def check_subset(pairs: ExpertPairs, limit: int, seed: int, n_experts: int = 8) -> torch.Tensor:
    """Pairs of a few random experts (<= limit): the fp64 references then touch few weight matrices."""
    g = torch.Generator().manual_seed(seed)
    slot = pairs.slot.cpu()
    chosen = torch.unique(slot[torch.randperm(slot.numel(), generator=g)[:n_experts]])
    sel = torch.nonzero(torch.isin(slot, chosen)).squeeze(1)[:limit]
    return sel.to(pairs.slot.device)


def rel_l2(y: torch.Tensor, r: torch.Tensor) -> float:
    return float((y.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30))


def expert_matrices(wd: ExpertWeights, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (W1, W2) of local expert ``e``: bf16 weights widened, MXFP4 ones dequantised (the same values:
    an e2m1 code times a power of two is exact in bf16), so a reference needs no dequantised copy of all
    experts (``bench layer --emulate`` keeps one only for rank 0)."""
    if wd.fmt == "bf16":
        return wd.w1[e].float(), wd.w2[e].float()
    w = wd.as_rowmajor()
    return (dequantize_mx(MXTensor(w.w1[e], w.w1_scale[e], "fp4")),
            dequantize_mx(MXTensor(w.w2[e], w.w2_scale[e], "fp4")))


def token_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, wd: ExpertWeights,
                    limit: float | None, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 rows [len(tokens), H] of the route-weighted sum over each token's pairs: subset_reference's
    exact=False math (fp32 on dequantised weights, unquantised activations), what a fused MoE call (a
    peer, the layer) returns per token. ``ids`` [T, k] are local expert ids of ``wd``; -1 marks a pair
    on another rank (skipped: the partial sum an EP rank returns)."""
    rows = x[tokens].float()
    ids_t, w_t = ids[tokens], weights[tokens].float()
    out = torch.zeros(tokens.numel(), wd.hidden, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids_t[ids_t >= 0]).tolist():
        t_idx, j = torch.nonzero(ids_t == e, as_tuple=True)
        w1, w2 = expert_matrices(wd, e)
        act = swiglu(rows[t_idx] @ w1.T, wd.gate_up_layout, limit)
        out.index_add_(0, t_idx, (act @ w2.T) * w_t[t_idx, j, None])
    return out


def check_tokens(n_tokens: int, limit: int, seed: int, device: torch.device) -> torch.Tensor:
    """Up to ``limit`` random token indices of ``n_tokens`` (sorted): the tokens a per-token relL2 reads."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n_tokens, generator=g)[:limit].sort().values.to(device)
