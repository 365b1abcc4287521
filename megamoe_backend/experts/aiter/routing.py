"""Top-k ids in the rank-major space aiter's runtimes and mori route by: rank = id // experts_per_rank.

Why remap: our ExpertPlacement may put any physical expert on any rank; aiter and mori only know
``id // experts_per_rank``. ``owner[e] * epr + slot[e]`` gives every placement with an equal
expert count per rank that form. Masked entries (-1) become a copy of the token's first valid id
with weight 0 (a token reaches a rank once, so no extra traffic); a fully masked token is sent
to expert 0 with weight 0.
"""

from __future__ import annotations

import torch


def rank_major_ids(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, owner: torch.Tensor, slot: torch.Tensor, experts_per_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (int32 ids [T, k], fp32 weights [T, k]), both contiguous, as both runtimes require."""
    ids = topk_ids.to(torch.int64)
    valid = ids >= 0
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    mapped = owner.to(ids.device)[safe] * experts_per_rank + slot.to(ids.device)[safe]
    weights = torch.where(valid, topk_weights.to(torch.float32), torch.zeros((), dtype=torch.float32, device=ids.device))
    if not bool(valid.all()):
        big = torch.iinfo(torch.int64).max
        first = torch.where(valid, mapped, torch.full_like(mapped, big)).min(dim=1).values
        first = torch.where(first == big, torch.zeros_like(first), first)
        mapped = torch.where(valid, mapped, first.unsqueeze(1).expand_as(mapped))
    return mapped.to(torch.int32).contiguous(), weights.contiguous()
