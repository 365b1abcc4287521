"""torch.distributed all_to_all transport: NCCL / RCCL on GPUs, gloo on CPU.

Two collectives per dispatch (a small [ep, 4] header, then the rows with their routing metadata
packed behind the payload, so a row travels as one contiguous byte run) and one per combine. The
header carries each rank's status word and token bound, which is how bad input (or disagreeing
bounds) on one rank becomes an error on all ranks instead of a hang. A dead peer surfaces as a
timeout or connection error of the process group (its ``timeout`` is set where the group is
created) and is re-raised as TransportError.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import DispatchHandle, DispatchResult, PeerInputError, Transport, TransportError
from .bound_header import bound_disagreement
from .layout import DispatchLayout, pack_dispatch_rows, unpack_dispatch_rows

STATUS_MEANING = {
    1: "more tokens than MEGA_MAX_TOKENS_PER_RANK",
    2: "expert id out of range",
    3: "bad input tensor",
    4: "max_tokens_across_ranks out of [its tokens, MEGA_MAX_TOKENS_PER_RANK]",
}


class TorchDistTransport(Transport):
    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.ep_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.name = dist.get_backend(group)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, what: str) -> None:
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses on timeout or dead peer
            raise TransportError(
                f"[megamoe] {what} all_to_all failed on ep_rank={self.rank} (a peer died, timed out or "
                f"disagrees on sizes): {exc}"
            ) from exc

    def dispatch(self, token_rows: torch.Tensor, layout: DispatchLayout, status: int = 0, bound: int = 0) -> DispatchResult:
        ep = self.ep_size
        header = torch.stack(
            (layout.send_rank_counts, layout.pair_rank_counts, torch.full((ep,), status, dtype=torch.int64, device=self.device),
             torch.full((ep,), bound, dtype=torch.int64, device=self.device)),
            dim=1,
        ).to(torch.int64).contiguous()
        recv_header = torch.empty_like(header)
        self._all_to_all(recv_header, header, None, None, "dispatch header")
        recv_header = recv_header.cpu()
        bad = [(src, int(code)) for src, code in enumerate(recv_header[:, 2].tolist()) if code]
        if bad:
            detail = "; ".join(f"ep_rank {src}: {STATUS_MEANING.get(code, f'status {code}')}" for src, code in bad)
            raise PeerInputError(f"[megamoe] dispatch refused on every rank because of bad input ({detail})")
        disagreement = bound_disagreement(recv_header[:, 3].tolist())
        if disagreement:
            raise PeerInputError(f"[megamoe] dispatch refused on every rank: {disagreement}")
        recv_counts = recv_header[:, 0].tolist()
        recv_pairs = recv_header[:, 1].tolist()

        send = pack_dispatch_rows(token_rows, layout)
        recv = torch.empty(sum(recv_counts), send.shape[1], dtype=torch.uint8, device=self.device)
        self._all_to_all(recv, send, recv_counts, layout.send_rank_counts.tolist(), "dispatch rows")
        rows, slots, weights = unpack_dispatch_rows(recv, token_rows.shape[1], layout.topk)
        return DispatchResult(rows, slots, weights, DispatchHandle(layout, recv_counts, recv_pairs))

    def combine(self, pair_rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        back_counts = handle.layout.pair_rank_counts.tolist()
        out = torch.empty(sum(back_counts), pair_rows.shape[1], dtype=pair_rows.dtype, device=self.device)
        self._all_to_all(out, pair_rows.contiguous(), back_counts, handle.recv_pair_counts, "combine")
        return out


class LocalTransport(Transport):
    """ep_size == 1 without a process group: the same layout contract, no communication."""

    name = "local"

    def dispatch(self, token_rows: torch.Tensor, layout: DispatchLayout, status: int = 0, bound: int = 0) -> DispatchResult:
        if status:
            raise PeerInputError(f"[megamoe] dispatch refused: {STATUS_MEANING.get(status, f'status {status}')}")
        rows = token_rows.index_select(0, layout.send_token)
        n_pairs = int(layout.pair_rank_counts.sum())
        handle = DispatchHandle(layout, [rows.shape[0]], [n_pairs])
        return DispatchResult(rows, layout.send_slots, layout.send_weights, handle)

    def combine(self, pair_rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return pair_rows
