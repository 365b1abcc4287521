"""route(): scoring functions, grouped top-k, correction bias, renormalisation, scaling.

Checked against a per-token loop written from DeepSeek's description (independent of the
vectorised implementation)."""

from __future__ import annotations

import math

import pytest
import torch

from megamoe_backend.layer import route
from megamoe_backend.spec import MoESpec


def loop_route(logits, spec, bias):
    ids, ws = [], []
    for row in logits.tolist():
        if spec.scoring_func == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            scores = [v / sum(ex) for v in ex]
        elif spec.scoring_func == "sigmoid":
            scores = [1 / (1 + math.exp(-v)) for v in row]
        else:
            scores = [math.sqrt(math.log1p(math.exp(v))) for v in row]
        choose = [s + (float(bias[i]) if bias is not None else 0.0) for i, s in enumerate(scores)]
        per = len(row) // spec.n_group
        groups = [choose[g * per : (g + 1) * per] for g in range(spec.n_group)]
        gscore = [sum(sorted(g, reverse=True)[:2]) if spec.topk_method == "noaux_tc" else max(g) for g in groups]
        keep = sorted(range(spec.n_group), key=lambda g: -gscore[g])[: spec.topk_group]
        cand = [i for i in range(len(row)) if i // per in keep]
        top = sorted(cand, key=lambda i: -choose[i])[: spec.num_experts_per_tok]
        w = [scores[i] for i in top]
        if spec.norm_topk_prob:
            w = [v / sum(w) for v in w]
        ids.append(top)
        ws.append([v * spec.routed_scaling_factor for v in w])
    return torch.tensor(ids), torch.tensor(ws)


@pytest.mark.parametrize(
    "scoring, method, n_group, topk_group, norm",
    [("softmax", "greedy", 1, 1, False), ("sigmoid", "noaux_tc", 4, 2, True), ("sqrtsoftplus", "noaux_tc", 1, 1, True),
     ("softmax", "group_limited_greedy", 4, 1, True)],
)
def test_route_matches_loop(scoring, method, n_group, topk_group, norm) -> None:
    spec = MoESpec(hidden_size=32, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                   topk_group=topk_group, scoring_func=scoring, topk_method=method, routed_scaling_factor=2.5, norm_topk_prob=norm)
    logits = torch.randn(20, 16, dtype=torch.float64).float()
    bias = torch.randn(16) * 0.3 if method == "noaux_tc" else None
    ids, w = route(logits, spec, bias)
    ref_ids, ref_w = loop_route(logits, spec, bias)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w.float(), rtol=1e-5, atol=1e-6)


def test_bias_changes_choice_not_weights() -> None:
    spec = MoESpec(hidden_size=32, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                   scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=False)
    logits = torch.zeros(1, 8)
    bias = torch.zeros(8)
    bias[5] = bias[6] = 1.0
    ids, w = route(logits, spec, bias)
    assert sorted(ids[0].tolist()) == [5, 6]
    torch.testing.assert_close(w, torch.full((1, 2), 0.5))


def test_bad_shapes() -> None:
    spec = MoESpec(hidden_size=32, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"\[tokens, 8\]"):
        route(torch.randn(3, 7), spec)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        route(torch.randn(3, 8), spec, torch.zeros(7))
