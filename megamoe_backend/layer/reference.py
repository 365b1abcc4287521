"""fp32 reference MoE: the accuracy yardstick for every wire and quant scheme.

Plain fp32 math on dequantised weights, no EP, no activation quantisation, written as directly as
possible (loop over experts, index_add) so it shares no code path with the layer it checks.
"""

from __future__ import annotations

import torch


def fp32_reference_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    gate_up_layout: str = "interleaved",
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """x [T, H]; w1 [E, 2I, H], w2 [E, H, I] (fp32, all experts, logical ids) -> fp32 [T, H]."""
    xf = x.to(torch.float32)
    out = torch.zeros_like(xf)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        tok, kpos = torch.nonzero(topk_ids == e, as_tuple=True)
        h = xf[tok] @ w1[e].to(torch.float32).T
        if gate_up_layout == "interleaved":
            g, u = h[:, 0::2], h[:, 1::2]
        else:
            g, u = h.chunk(2, dim=-1)
        if swiglu_limit is not None:
            g = torch.clamp(g, max=swiglu_limit)
            u = torch.clamp(u, -swiglu_limit, swiglu_limit)
        y = (g * torch.sigmoid(g) * u) @ w2[e].to(torch.float32).T
        out.index_add_(0, tok, y * topk_weights[tok, kpos].to(torch.float32).unsqueeze(1))
    return out


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (b is the reference)."""
    a64, b64 = a.double(), b.double()
    return float(torch.linalg.vector_norm(a64 - b64) / torch.linalg.vector_norm(b64).clamp_min(1e-30))
