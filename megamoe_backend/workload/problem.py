"""Synthetic MoE problems: same weights on every rank from a seed, tokens sharded by rank.

Why seeded instead of shipped: multi-rank runs (demo, tests, GPU validation) need identical
expert weights on all ranks and an identical global batch to compare against a single-process
result; regenerating from (spec, seed) costs nothing and pickles nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..experts import ExpertWeights, deinterleave_gate_up, quantize_expert_weights
from ..layer.routing import route
from ..plan import ExpertPlacement
from ..spec import MoESpec

WEIGHT_FMT_FOR_QUANT = {"bf16": "bf16", "fp8_block": "fp8_block", "a8w4": "mxfp4", "a4w4": "mxfp4"}


@dataclass(frozen=True)
class ProblemConfig:
    spec: MoESpec
    tokens_per_rank: int
    ep_size: int
    seed: int = 0
    masked_fraction: float = 0.0  # share of top-k entries set to -1


@dataclass
class Problem:
    cfg: ProblemConfig
    w1: torch.Tensor  # fp32 [E, 2I, H] (interleaved gate/up), logical experts
    w2: torch.Tensor  # fp32 [E, H, I]
    x: torch.Tensor  # bf16 [ep * T, H]
    topk_ids: torch.Tensor  # int64 [ep * T, k]
    topk_weights: torch.Tensor  # fp32 [ep * T, k]

    def shard(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self.cfg.tokens_per_rank
        sl = slice(rank * t, (rank + 1) * t)
        return self.x[sl], self.topk_ids[sl], self.topk_weights[sl]

    def to(self, device: torch.device | str) -> "Problem":
        return Problem(self.cfg, self.w1.to(device), self.w2.to(device), self.x.to(device),
                       self.topk_ids.to(device), self.topk_weights.to(device))

    def expert_weights(self, quant: str) -> ExpertWeights:
        """All logical experts in the format the quant scheme runs on."""
        if quant == "fp8_block":  # 128 x 128 blocks over the checkpoint's plain [gate; up] rows, as DeepSeek's
            return quantize_expert_weights(deinterleave_gate_up(self.w1), self.w2, "fp8_block", "plain")
        return quantize_expert_weights(self.w1, self.w2, WEIGHT_FMT_FOR_QUANT[quant])


def make_problem(cfg: ProblemConfig) -> Problem:
    s = cfg.spec
    g = torch.Generator().manual_seed(cfg.seed)
    e, h, i = s.n_routed_experts, s.hidden_size, s.moe_intermediate_size
    w1 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    n = cfg.tokens_per_rank * cfg.ep_size
    x = torch.randn(n, h, generator=g).to(torch.bfloat16)
    logits = torch.randn(n, e, generator=g)
    bias = torch.randn(e, generator=g) * 0.1 if s.topk_method == "noaux_tc" else None
    ids, weights = route(logits, s, correction_bias=bias)
    if cfg.masked_fraction > 0:
        mask = torch.rand(ids.shape, generator=g) < cfg.masked_fraction
        ids = torch.where(mask, torch.full_like(ids, -1), ids)
    return Problem(cfg, w1, w2, x, ids, weights)


def local_weights(all_experts: ExpertWeights, placement: ExpertPlacement, rank: int) -> ExpertWeights:
    """The slice of ``all_experts`` (indexed by logical id) that ``rank`` holds, in slot order."""
    logical = [placement.logical_of_physical[p] for p in placement.local_experts(rank)]
    idx = torch.tensor(logical, dtype=torch.long)
    pick = lambda t: None if t is None else t.index_select(0, idx.to(t.device)).contiguous()  # noqa: E731
    return ExpertWeights(
        pick(all_experts.w1), pick(all_experts.w2), all_experts.fmt, all_experts.gate_up_layout,
        pick(all_experts.w1_scale), pick(all_experts.w2_scale),
    )
