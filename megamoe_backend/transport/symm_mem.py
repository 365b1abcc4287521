"""NVLink P2P transport over torch symmetric memory for the torch forward (MEGA_DISPATCH=symm, CUDA only).

With the Triton experts, MEGA_DISPATCH=symm runs the device P2P forward instead (layer/device/p2p.py
over transport/peer_arena.py: captured, no host sync); this eager, copy-based transport serves the
torch forward (e.g. the torch reference experts on CUDA).

Every rank allocates one symmetric byte buffer; peers' buffers are mapped into each process, so
a rank *writes* its rows straight into the destination's receive region (an NVLink copy, no
NCCL kernel, no staging on the receiver), then all ranks meet at a device-side barrier.

Buffer of each rank (offsets fixed by the plan, which is why the transport cache keys on it):
  header   [ep, 4] int64   row s: (rows from s, pairs from s, status of s, unused)
  dispatch [ep, MTPR, W]   region s: rows sent by rank s (<= MTPR: one row per token per rank)
  combine  [ep, MTPR*k, C] region r: pair rows returned by rank r
Reuse across forwards is safe without extra fences: a peer can only write the next forward's
rows after passing a barrier that this rank signals after it has read the current ones.

The combine copy runs after GEMM2 as its own copy; the epilogue writes into the local pair
buffer, not into the peer's buffer directly (a fused epilogue write is future work).
Validated on 2 x H200 (NVLink) by scripts/gpu_validate.py (benchmarks/results/h200x2_gpu_validate.json:
bit-identical to the NCCL transport for bf16, fp8 and fp4 wires); not testable on CPU CI.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .base import DispatchHandle, DispatchResult, PeerInputError, Transport, TransportError
from .layout import DispatchLayout, pack_dispatch_rows, unpack_dispatch_rows
from .torch_dist import STATUS_MEANING

_ALIGN = 256
BARRIER_TIMEOUT_MS = 60_000


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class SymmMemTransport(Transport):
    name = "symm"

    def __init__(self, plan, group, device: torch.device) -> None:
        if torch.device(device).type != "cuda":
            raise TransportError("MEGA_DISPATCH=symm needs CUDA devices (torch symmetric memory over NVLink)")
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as exc:
            raise TransportError(f"MEGA_DISPATCH=symm: this torch has no symmetric memory ({exc})") from exc
        self.group = group
        self.device = torch.device(device)
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.mtpr = plan.mtpr
        self.topk = plan.topk
        self.row_width = plan.dispatch.row_bytes(plan.hidden) + 8 * plan.topk  # payload | slots i32 | weights f32
        self.comb_width = plan.combine.row_bytes(plan.hidden)
        self.header_off = 0
        self.dispatch_off = _align(self.ep * 4 * 8)
        self.combine_off = self.dispatch_off + _align(self.ep * self.mtpr * self.row_width)
        total = self.combine_off + _align(self.ep * self.mtpr * self.topk * self.comb_width)
        group_name = group.group_name
        try:
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed on torch <= 2.7, a no-op later
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    symm_mem.enable_symm_mem_for_group(group_name)
            self.buffer = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
            self.handle = symm_mem.rendezvous(self.buffer, group_name)
        except Exception as exc:
            raise TransportError(f"MEGA_DISPATCH=symm: symmetric memory rendezvous failed on rank {self.rank}: {exc}") from exc
        self.peers = [self.handle.get_buffer(r, (total,), torch.uint8, 0) for r in range(self.ep)]
        self.bytes = total

    # views of one rank's buffer
    def _header(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.header_off : self.header_off + self.ep * 32].view(torch.int64).view(self.ep, 4)

    def _dispatch_region(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        start = self.dispatch_off + src * self.mtpr * self.row_width
        return buf[start : start + self.mtpr * self.row_width].view(self.mtpr, self.row_width)

    def _combine_region(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        rows = self.mtpr * self.topk
        start = self.combine_off + src * rows * self.comb_width
        return buf[start : start + rows * self.comb_width].view(rows, self.comb_width)

    def _barrier(self) -> None:
        try:
            self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        except TypeError:  # older signature without timeout_ms
            self.handle.barrier(channel=0)
        except Exception as exc:
            raise TransportError(f"[megamoe] symm barrier failed on rank {self.rank} (peer dead or timed out): {exc}") from exc

    def dispatch(self, token_rows: torch.Tensor, layout: DispatchLayout, status: int = 0) -> DispatchResult:
        ep, me = self.ep, self.rank
        counts = layout.send_rank_counts.tolist()
        pairs = layout.pair_rank_counts.tolist()
        if max(counts, default=0) > self.mtpr:
            raise PeerInputError(f"[megamoe] {max(counts)} rows for one rank exceed MEGA_MAX_TOKENS_PER_RANK={self.mtpr}")
        send = pack_dispatch_rows(token_rows, layout)
        header_rows = torch.tensor([[c, p, status, 0] for c, p in zip(counts, pairs)], dtype=torch.int64, device=self.device)
        start = 0
        for r in range(ep):
            self._header(self.peers[r])[me].copy_(header_rows[r])
            if counts[r]:
                self._dispatch_region(self.peers[r], me)[: counts[r]].copy_(send[start : start + counts[r]])
            start += counts[r]
        self._barrier()
        header = self._header(self.buffer).cpu()
        bad = [(s, int(c)) for s, c in enumerate(header[:, 2].tolist()) if c]
        if bad:
            detail = "; ".join(f"ep_rank {s}: {STATUS_MEANING.get(c, f'status {c}')}" for s, c in bad)
            self._barrier()  # keep every rank's barrier count aligned before raising
            raise PeerInputError(f"[megamoe] dispatch refused on every rank because of bad input ({detail})")
        recv_counts = header[:, 0].tolist()
        recv_pairs = header[:, 1].tolist()
        recv = torch.cat([self._dispatch_region(self.buffer, s)[: recv_counts[s]] for s in range(ep)])
        rows, slots, weights = unpack_dispatch_rows(recv, token_rows.shape[1], self.topk)
        return DispatchResult(rows, slots, weights, DispatchHandle(layout, recv_counts, recv_pairs))

    def combine(self, pair_rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        me = self.rank
        start = 0
        for s, n in enumerate(handle.recv_pair_counts):
            if n:
                self._combine_region(self.peers[s], me)[:n].copy_(pair_rows[start : start + n])
            start += n
        self._barrier()
        back = handle.layout.pair_rank_counts.tolist()
        return torch.cat([self._combine_region(self.buffer, r)[: back[r]] for r in range(self.ep)])
