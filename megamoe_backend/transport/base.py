"""Transport interface: move dispatch rows to expert owners and combine rows back.

Why only two calls: the layer decides *what* travels (one encoded row per token, quantised once;
one route-weighted row per (token, expert) pair back); a transport only decides *how* bytes move
(all_to_all over NCCL/RCCL/gloo, NVLink P2P writes into peers' symmetric buffers, mori). Adding a
transport therefore touches no expert kernel, and vice versa (N + M pieces, not N x M).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .layout import DispatchLayout


class TransportError(RuntimeError):
    """A collective failed or timed out, or a rank reported bad input; no rank continues silently."""


class PeerTimeoutError(TransportError):
    """A device-side wait for a peer passed MEGA_P2P_TIMEOUT_S: the peer died or hangs. The EP group
    cannot continue (its ranks no longer run the same step); the process and GPU context can."""


class PeerInputError(ValueError):
    """Bad input detected on some rank; raised on *every* rank so none waits in a collective."""


@dataclass
class DispatchHandle:
    layout: DispatchLayout
    recv_rank_counts: list[int]  # rows received from each source rank
    recv_pair_counts: list[int]  # combine rows to send back to each source rank


@dataclass
class DispatchResult:
    rows: torch.Tensor  # uint8 [R, row_bytes] wire rows, grouped by source rank
    slots: torch.Tensor  # int32 [R, k] local expert slot per top-k entry, -1 if not here
    weights: torch.Tensor  # fp32 [R, k]
    handle: DispatchHandle


class Transport(ABC):
    """Moves wire rows between the ranks of one EP group."""

    name: str = "abstract"

    @abstractmethod
    def dispatch(self, token_rows: torch.Tensor, layout: DispatchLayout, status: int = 0, bound: int = 0) -> DispatchResult:
        """Send ``token_rows[layout.send_token]`` (one row per token per destination) with routing metadata.

        ``status`` != 0 reports bad input on this rank; every rank then raises PeerInputError.
        ``bound``: the forward's max_tokens_across_ranks (0: none), carried with the status; ranks
        that passed different bounds all raise PeerInputError (transport/bound_header.py).
        """

    @abstractmethod
    def combine(self, pair_rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Return received-pair rows to their sources; result is in ``handle.layout``'s pair order."""
