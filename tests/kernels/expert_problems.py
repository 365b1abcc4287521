"""Random expert problems shared by the interpreter and GPU test modules (no Triton import here)."""

from __future__ import annotations

import torch

from megamoe_backend.experts import ExpertPairs, quantize_expert_weights

# relL2 vs the exact reference allowed to the frag8 GEMMs (FP8 tensor core): it adds products with fewer
# bits than fp32 (H200: 2.0e-3 small, 3.2e-3 / 9.6e-3 a4w4 / a8w4 at K = 7168). The layer twin's bounds
# (quantised_twin.py) are derived from it: a pair row may differ from the exact one by this much.
FRAG8_TOL = 2e-2


def make_problem(wfmt, layout="interleaved", n_exp=3, hidden=64, inter=64, tokens=6, topk=2, seed=0):
    """(ExpertWeights in ``wfmt``, bf16 tokens [tokens, hidden], top-k ExpertPairs) on the CPU."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(n_exp, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(n_exp, hidden, inter, generator=g) / inter**0.5
    weights = quantize_expert_weights(w1, w2, wfmt, layout)
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(torch.bfloat16)
    ids = torch.rand(tokens, n_exp, generator=g).topk(topk, dim=1).indices
    pairs = ExpertPairs(torch.arange(tokens).repeat_interleave(topk), ids.reshape(-1).contiguous(), torch.rand(tokens * topk, generator=g))
    return weights, x, pairs

