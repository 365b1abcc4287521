"""Top-k ids in the rank-major space aiter's runtimes and mori route by: rank = id // experts_per_rank.

Why remap: our ExpertPlacement may put any physical expert on any rank; aiter and mori only know
``id // experts_per_rank``. ``owner[e] * epr + slot[e]`` gives every placement with an equal
expert count per rank that form. An entry that must not run -- masked (-1) or a bad id (out of
range: never used as an index; the caller's status word reports it) -- becomes a copy of the
token's first valid id with weight 0 (a token reaches a rank once, so no extra traffic); a token
with no valid entry is sent to expert 0 with weight 0. No -1 is handed on: MegaMoEV2 skips -1 slots
only with ``mask_invalid_slots``, which ROCm/aiter 4d06fb8d leaves off by default because "the id
check costs prefill time" (mega_moe/envs.py, AITER_MEGA_COMBINE_MASK), and vLLM 0.34 never asks for it.

Device ops only, with shapes from T and k: no host synchronisation (a ``bool(...)`` here stalled
every layer and kept the path out of CUDA graphs), so the step can be captured.
"""

from __future__ import annotations

import torch

_BIG = torch.iinfo(torch.int64).max


def rank_major_ids(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, owner: torch.Tensor, slot: torch.Tensor, experts_per_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (int32 ids [T, k], fp32 weights [T, k]), both contiguous, as both runtimes require."""
    ids = topk_ids.to(torch.int64)
    owner, slot = owner.to(ids.device), slot.to(ids.device)
    valid = (ids >= 0) & (ids < owner.shape[0])
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    mapped = owner[safe] * experts_per_rank + slot[safe]
    weights = torch.where(valid, topk_weights.to(torch.float32), torch.zeros((), dtype=torch.float32, device=ids.device))
    first = torch.where(valid, mapped, torch.full_like(mapped, _BIG)).min(dim=1, keepdim=True).values
    first = torch.where(first == _BIG, torch.zeros_like(first), first)
    mapped = torch.where(valid, mapped, first.expand_as(mapped))
    return mapped.to(torch.int32).contiguous(), weights.contiguous()
