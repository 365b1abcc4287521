"""Top-k routing with the spec's scoring: softmax | sigmoid | sqrtsoftplus, grouped top-k,
DeepSeek's noaux_tc correction bias, top-k renormalisation and routed scaling.

The bias only steers *which* experts win; the weights come from the unbiased scores, as in
DeepSeek V3/V4. Engines that route themselves (vLLM, SGLang) hand ids and weights straight to the
layer; this function is what the CPU demo, the tests and engine-less users call.
"""

from __future__ import annotations

import torch

from ..spec import MoESpec


def expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    x = logits.to(torch.float32)
    if scoring_func == "softmax":
        return torch.softmax(x, dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(x)
    if scoring_func == "sqrtsoftplus":
        return torch.sqrt(torch.nn.functional.softplus(x))
    raise ValueError(f"scoring_func={scoring_func!r}; expected softmax, sigmoid or sqrtsoftplus")


def route(
    logits: torch.Tensor,
    spec: MoESpec,
    correction_bias: torch.Tensor | None = None,
    apply_routed_scaling: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (topk_ids int64 [T, k], topk_weights fp32 [T, k])."""
    if logits.dim() != 2 or logits.shape[1] != spec.n_routed_experts:
        raise ValueError(
            f"router logits must be [tokens, {spec.n_routed_experts}], got {tuple(logits.shape)}"
        )
    k = spec.num_experts_per_tok
    scores = expert_scores(logits, spec.scoring_func)
    choose = scores
    if correction_bias is not None:
        if correction_bias.shape != (spec.n_routed_experts,):
            raise ValueError(
                f"e_score_correction_bias must have shape ({spec.n_routed_experts},), got {tuple(correction_bias.shape)}"
            )
        choose = scores + correction_bias.to(torch.float32)
    if spec.n_group > 1:
        t = choose.shape[0]
        grouped = choose.view(t, spec.n_group, -1)
        if spec.topk_method == "noaux_tc":
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        else:
            group_score = grouped.amax(dim=-1)
        keep = group_score.topk(spec.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choose = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(t, -1)
    ids = choose.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob and k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if apply_routed_scaling:
        weights = weights * spec.routed_scaling_factor
    return ids, weights
