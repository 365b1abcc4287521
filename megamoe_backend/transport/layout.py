"""Dispatch layout: which token rows go to which rank, and where combined rows come back to.

Computed once per forward from the top-k ids (DeepEP's get_dispatch_layout, in spirit) and handed
to the transport; combine reuses it through the handle, so the caller never re-derives the order.

Order contract (shared by every transport):
- sent rows are grouped by destination rank, tokens ascending within a rank; a token goes to a
  rank at most once, however many of its top-k experts live there;
- each sent row carries, per top-k entry, the local slot on that rank (-1 if not there) and its
  route weight (0 where the slot is -1);
- combine returns one row per valid (sent row, top-k entry) pair, in sent-row order then k order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DispatchLayout:
    ep_size: int
    num_tokens: int
    topk: int
    send_token: torch.Tensor  # int64 [S]: token index of each sent row
    send_rank_counts: torch.Tensor  # int64 [ep]: rows sent to each rank
    send_slots: torch.Tensor  # int32 [S, k]
    send_weights: torch.Tensor  # fp32 [S, k]
    pair_token: torch.Tensor  # int64 [Ptot]: token of each returning combine row
    pair_k: torch.Tensor  # int64 [Ptot]: top-k position of each returning combine row
    pair_rank_counts: torch.Tensor  # int64 [ep]: combine rows coming back from each rank

    @classmethod
    def build(
        cls,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        owner: torch.Tensor,
        slot: torch.Tensor,
        ep_size: int,
    ) -> "DispatchLayout":
        t, k = topk_ids.shape
        device = topk_ids.device
        valid = topk_ids >= 0
        safe_ids = torch.where(valid, topk_ids, torch.zeros_like(topk_ids))
        dest = torch.where(valid, owner[safe_ids], torch.full_like(topk_ids, -1))  # [T, k]
        local_slot = slot[safe_ids]
        ranks = torch.arange(ep_size, device=device)
        goes = (dest.unsqueeze(1) == ranks.view(1, ep_size, 1))  # [T, ep, k]
        to_rank = goes.any(dim=2)  # [T, ep]
        rank_idx, token_idx = torch.nonzero(to_rank.T, as_tuple=True)  # sorted by rank, then token
        row_goes = goes[token_idx, rank_idx]  # [S, k]
        send_slots = torch.where(row_goes, local_slot[token_idx], torch.full_like(local_slot[token_idx], -1)).to(torch.int32)
        send_weights = torch.where(row_goes, topk_weights[token_idx].to(torch.float32), torch.zeros((), device=device))
        pair_row, pair_k = torch.nonzero(row_goes, as_tuple=True)
        send_rank_counts = torch.bincount(rank_idx, minlength=ep_size)
        pair_rank_counts = torch.bincount(rank_idx[pair_row], minlength=ep_size)
        return cls(
            ep_size=ep_size,
            num_tokens=t,
            topk=k,
            send_token=token_idx,
            send_rank_counts=send_rank_counts,
            send_slots=send_slots,
            send_weights=send_weights,
            pair_token=token_idx[pair_row],
            pair_k=pair_k,
            pair_rank_counts=pair_rank_counts,
        )


def received_pairs(recv_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On the receiver: (row, k) of every valid received pair, in the order combine sends them back."""
    return torch.nonzero(recv_slots >= 0, as_tuple=True)


def pack_dispatch_rows(token_rows: torch.Tensor, layout: DispatchLayout) -> torch.Tensor:
    """One contiguous byte row per (token, destination): wire payload | int32 slots | fp32 weights.

    Shared by every byte-moving transport so the row format is defined once; the token's wire row
    was quantised once and is only copied here, once per destination rank.
    """
    return torch.cat(
        (
            token_rows.index_select(0, layout.send_token),
            layout.send_slots.contiguous().view(torch.uint8),
            layout.send_weights.contiguous().view(torch.uint8),
        ),
        dim=1,
    )


def unpack_dispatch_rows(recv: torch.Tensor, row_bytes: int, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_dispatch_rows`: (wire rows, int32 slots [R, k], fp32 weights [R, k])."""
    rows = recv[:, :row_bytes]
    slots = recv[:, row_bytes : row_bytes + 4 * topk].contiguous().view(torch.int32)
    weights = recv[:, row_bytes + 4 * topk :].contiguous().view(torch.float32)
    return rows, slots, weights
