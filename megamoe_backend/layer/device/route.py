"""Top-k ids -> this rank's expert pairs, on the device, in one launch, with the id check.

Why a kernel: the torch layout (``DispatchLayout.build``) finds the valid (token, k) entries with
``nonzero``, which sizes its result from the data (a host synchronisation, not capturable). Here
every (token, k) entry keeps its place, pair p = token * k + j, and entries that do not run here
(masked -1, owned by another rank, or a bad id) get slot -1: the expert layout gives them no row
(experts/triton/layout_kernels.py) and the top-k sum skips them. Sizes depend on T and k only.

A bad id (< -1 or >= the physical expert count) is never used as an index: it contributes nothing
and the first one is recorded in the status word (status.py) with its value and token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .status import BAD_EXPERT_ID

BLOCK = 1024


@triton.jit
def _route_pairs_kernel(
    ids_ptr, weights_ptr, owner_ptr, slot_ptr, n_pairs, num_physical, rank,
    pair_slot_ptr, pair_weight_ptr, status_ptr, layer_id,
    K: tl.constexpr, BAD_CODE: tl.constexpr, BLOCK: tl.constexpr,
):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = p < n_pairs
    e = tl.load(ids_ptr + p, mask=live, other=-1).to(tl.int64)
    known = (e >= 0) & (e < num_physical)
    bad = live & ((e < -1) | (e >= num_physical))
    safe = tl.where(known, e, 0)
    owner = tl.load(owner_ptr + safe, mask=live & known, other=-1)
    slot = tl.load(slot_ptr + safe, mask=live & known, other=-1)
    here = known & (owner == rank)
    w = tl.load(weights_ptr + p, mask=live, other=0.0).to(tl.float32)
    tl.store(pair_slot_ptr + p, tl.where(here, slot, -1).to(tl.int64), mask=live)
    tl.store(pair_weight_ptr + p, tl.where(here, w, 0.0), mask=live)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    if n_bad > 0:
        first = tl.min(tl.where(bad, p, n_pairs), axis=0)
        value = tl.sum(tl.where(p == first, e, 0), axis=0)
        zero = n_bad.to(tl.int64) * 0  # int64 operands: the CAS must match the word's type
        if tl.atomic_cas(status_ptr, zero, zero + BAD_CODE) == 0:  # first problem wins
            tl.store(status_ptr + 1, zero + layer_id)  # (an int arg may arrive as a constant)
            tl.store(status_ptr + 2, value.to(tl.int64))
            tl.store(status_ptr + 3, (first // K).to(tl.int64))


def route_pairs(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, owner: torch.Tensor, slot: torch.Tensor, rank: int,
    pair_slot: torch.Tensor, pair_weight: torch.Tensor, status_word: torch.Tensor, layer_id: int,
) -> None:
    """Fill ``pair_slot`` (int64 [T*k], -1 = not here) and ``pair_weight`` (fp32 [T*k], 0 where -1)."""
    t, k = topk_ids.shape
    n = t * k
    if n == 0:
        return
    _route_pairs_kernel[(triton.cdiv(n, BLOCK),)](
        topk_ids.contiguous(), topk_weights.contiguous(), owner, slot, n, owner.shape[0], rank,
        pair_slot, pair_weight, status_word, layer_id, K=k, BAD_CODE=BAD_EXPERT_ID, BLOCK=BLOCK,
    )


def route_pairs_torch(topk_ids: torch.Tensor, topk_weights: torch.Tensor, owner: torch.Tensor, slot: torch.Tensor,
                      rank: int) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """The same in torch ops (tests' reference): (pair_slot, pair_weight, first bad id or None)."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    known = (ids >= 0) & (ids < owner.shape[0])
    safe = torch.where(known, ids, torch.zeros_like(ids))
    here = known & (owner[safe] == rank)
    pair_slot = torch.where(here, slot[safe], torch.full_like(ids, -1))
    pair_weight = torch.where(here, topk_weights.reshape(-1).to(torch.float32), torch.zeros((), device=ids.device))
    bad = ~known & (ids != -1)
    first_bad = int(ids[bad][0]) if bool(bad.any()) else None
    return pair_slot, pair_weight, first_bad
