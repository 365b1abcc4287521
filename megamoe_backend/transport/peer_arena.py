"""Peer arenas: one byte buffer per EP rank that every other rank of the group can write.

Why: the device P2P forward (layer/forwards/p2p.py) has each sender write its token rows straight
into the owner's receive region and each owner's GEMM2 write its rows straight into the source's
combine region, with flags in the same buffers as the barrier. All it needs from a transport is
that buffer and, per peer, where that peer's buffer lies in this process's address space. Kernels
address peer r's byte b as ``local + offset[r] + b``: one int64 offset per peer (offset[me] = 0),
so the kernels take one pointer and never an address table, and work the same on every backend.

Backends (allocation and rendezvous are eager, before any graph capture):
- ``SymmPeerArena``: torch symmetric memory (GPUs of one NVLink domain). Refuses several ranks
  on one GPU (torch: "detected allocations from overlapping devices from different ranks").
- ``IpcPeerArena``: CUDA IPC handles exchanged over the group (ranks of one host, also several
  rank processes sharing one GPU: what the GPU tests run); on CPU (the Triton interpreter in CI)
  the same arena is a shared-memory file mapped by every rank.
- a group's own: a group object with a ``peer_arena(layout, device)`` method builds the arenas of
  ranks that are not processes (the one-process emulator, benchmarks/emulated_ep.py: the P2P
  forward's interpreter tests and the per-rank kernel times of ``megamoe bench layer --emulate``).
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .base import TransportError

ALIGN = 512  # every region starts on this many bytes (16-byte vector stores, int64 flags)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class ArenaLayout:
    """Byte offsets of the regions of every rank's arena (the same on all ranks; from the plan).

      flags       int64 [2, ep]                barrier phase x source rank: that source's epoch
      header      int64 [2, ep]                [0]: rows per source region the source assumed (checked);
                                               [1]: tokens it sent (the live head of its region)
      recv_rows   uint8 [ep * mtpr, row_bytes] region s (rows s*B .. s*B+B-1): token rows of source s
      recv_slot   int64 [ep * mtpr * k]        per received (row, k): local expert slot here, -1 = none
      recv_weight fp32  [ep * mtpr * k]        ... and its route weight
      combine     uint8 [mtpr * k, comb_bytes] this rank's own pairs (t * k + j) as written by their owner
    B = rows per source of this forward (<= mtpr, the same on every rank): regions are packed by B,
    so a received pair q = (s * B + t) * k + j reads received row q // k whatever B is.
    """

    ep: int
    mtpr: int
    topk: int
    row_bytes: int
    comb_bytes: int
    flags: int
    header: int
    recv_rows: int
    recv_slot: int
    recv_weight: int
    combine: int
    total: int

    @classmethod
    def build(cls, ep: int, mtpr: int, topk: int, row_bytes: int, comb_bytes: int) -> "ArenaLayout":
        pairs = ep * mtpr * topk
        offsets, at = [], 0
        for size in (2 * ep * 8, 2 * ep * 8, ep * mtpr * row_bytes, pairs * 8, pairs * 4, mtpr * topk * comb_bytes):
            offsets.append(at)
            at += align(size)
        return cls(ep, mtpr, topk, row_bytes, comb_bytes, *offsets, total=at)


class PeerArena:
    """This rank's arena (``local``, uint8 [total]) and the byte offsets of every peer's arena."""

    name = "abstract"
    needs_handshake = True  # peers in other processes: prove at start-up that each can write here (transport/handshake.py)

    def __init__(self, layout: ArenaLayout, rank: int, local: torch.Tensor, peers: list[torch.Tensor]) -> None:
        self.layout, self.rank, self.ep = layout, rank, layout.ep
        self.local = local
        # the same bytes typed for the kernels' int16 / int64 / fp32 stores (made once, not per launch)
        self.as_i16, self.as_i64, self.as_f32 = (local.view(d) for d in (torch.int16, torch.int64, torch.float32))
        self._peers = peers  # keeps the mappings alive as long as the arena lives
        self.peer_offsets = torch.tensor(aligned_offsets(local, peers), dtype=torch.int64, device=local.device)

    def view(self, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        """``count`` elements of ``dtype`` of this rank's arena from byte ``offset``."""
        size = torch.empty(0, dtype=dtype).element_size()
        return self.local[offset : offset + count * size].view(dtype)

    def peer_bytes(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s arena as mapped in this process (uint8 [total]): the start-up handshake
        (transport/handshake.py) writes through it; kernels use ``peer_offsets`` instead."""
        return self._peers[rank]


def aligned_offsets(local: torch.Tensor, peers: list[torch.Tensor]) -> list[int]:
    """Each peer's arena as a byte offset from ``local``; raises unless every one is ALIGN-aligned."""
    base = local.data_ptr()
    offsets = [p.data_ptr() - base for p in peers]
    if any(o % ALIGN for o in offsets):
        raise TransportError(f"[megamoe] peer arenas are not {ALIGN}-byte aligned: offsets {offsets}")
    return offsets


class IpcPeerArena(PeerArena):
    """CUDA IPC (or, on CPU, a shared-memory file) exchanged with ``dist.all_gather_object``.

    Every rank reaches every collective whatever failed on it (allocation, a peer's handle that does
    not open): each phase ends in ``agree_on_setup``, so a failure on one rank raises the same
    TransportError on every rank instead of leaving the others in a barrier it never reaches."""

    name = "ipc"

    def __init__(self, layout: ArenaLayout, group, device: torch.device) -> None:
        device = torch.device(device)
        rank, ep = dist.get_rank(group), dist.get_world_size(group)
        if ep != layout.ep:
            raise TransportError(f"[megamoe] the EP group has {ep} ranks, the plan {layout.ep}")
        path, local, handle, peers = None, None, None, None
        with _setup_phase() as failure:
            if device.type == "cuda":
                local = torch.zeros(layout.total, dtype=torch.uint8, device=device)
                handle = _cuda_handle(local)
            else:  # the interpreter's CPU ranks: a file in /dev/shm mapped shared by every rank
                path = os.path.join(_shm_dir(), f"megamoe-arena-{uuid.uuid4().hex}-{rank}")
                local = torch.from_file(path, shared=True, size=layout.total, dtype=torch.uint8)
                local.zero_()
                handle = path
        try:
            handles = agree_on_setup(group, "ipc", "allocating its arena", failure.error, handle)
            with _setup_phase() as failure:
                peers = [local if r == rank else _open(handles[r], device) for r in range(ep)]
                aligned_offsets(local, peers)
            # also the barrier of the old form: every rank has mapped every file, they can go from the directory
            agree_on_setup(group, "ipc", "opening its peers' arenas", failure.error)
        finally:
            if path is not None and os.path.exists(path):
                os.unlink(path)
        super().__init__(layout, rank, local, peers)


class SymmPeerArena(PeerArena):
    """torch symmetric memory (CUDA backend): one allocation per rank, mapped by every peer.

    Allocation and mapping each end in ``agree_on_setup`` (as IpcPeerArena); the rendezvous between
    them is torch's own collective, which every rank enters once its allocation is agreed."""

    name = "symm"

    def __init__(self, layout: ArenaLayout, group, device: torch.device) -> None:
        rank = dist.get_rank(group)
        local, symm_mem = None, None
        with _setup_phase() as failure:
            import torch.distributed._symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed on torch <= 2.7, a no-op later
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    symm_mem.enable_symm_mem_for_group(group.group_name)
            local = symm_mem.empty(layout.total, dtype=torch.uint8, device=device)
            local.zero_()
        agree_on_setup(group, "symm", "allocating symmetric memory", failure.error, fix=SYMM_FIX)
        peers = None
        with _setup_phase() as failure:
            self.handle = symm_mem.rendezvous(local, group.group_name)
            peers = [self.handle.get_buffer(r, (layout.total,), torch.uint8, 0) for r in range(layout.ep)]
            aligned_offsets(local, peers)
        # also the old barrier: zeroed everywhere before any peer writes a flag
        agree_on_setup(group, "symm", "the symmetric memory rendezvous", failure.error, fix=SYMM_FIX)
        super().__init__(layout, rank, local, peers)


@dataclass
class SetupFailure:
    error: str | None = None  # "ExceptionType: message" of the local step that failed, None if it passed


@contextmanager
def _setup_phase():
    """``with _setup_phase() as failure:`` runs a local set-up step and keeps what went wrong
    (``failure.error``) instead of raising, so the rank still reaches the agreement after it."""
    failure = SetupFailure()
    try:
        yield failure
    except Exception as exc:  # every failure of the step is reported through the agreement, none is lost
        failure.error = f"{type(exc).__name__}: {exc}"


SYMM_FIX = "several ranks on one GPU: use MEGA_DISPATCH=ipc; no CUDA peer access: MEGA_DISPATCH=nccl"
IPC_FIX = "ranks on several hosts or without CUDA peer access: use MEGA_DISPATCH=nccl"


def agree_on_setup(group, kind: str, step: str, error: str | None, payload=None, fix: str = IPC_FIX) -> list:
    """Collective over ``group``: every rank's (payload, error) of one set-up step. Raise the same
    TransportError on every rank, naming each rank that failed and why, when any did; else the
    payloads in rank order. Every rank calls it whether its own step failed or not, so none waits
    on a peer's failure (only a dead peer can stall it: the process group's own timeout)."""
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (payload, error), group=group)
    failed = [(r, e) for r, (_, e) in enumerate(every) if e is not None]
    if failed:
        who = "; ".join(f"ep_rank {r}: {e}" for r, e in failed)
        raise TransportError(f"[megamoe] MEGA_DISPATCH={kind}: {step} failed on {len(failed)} of {len(every)} rank(s) "
                             f"({who}); {fix}")
    return [p for p, _ in every]


ARENAS = {"ipc": IpcPeerArena, "symm": SymmPeerArena}


def make_arena(kind: str, layout: ArenaLayout, group, device: torch.device) -> PeerArena:
    """The arena of MEGA_DISPATCH=``kind`` over ``group``; a group that builds its own (``peer_arena``:
    ranks in one process, see above) gets that one whatever the kind (the kernels are the same)."""
    own_arena = getattr(group, "peer_arena", None)
    if own_arena is not None:
        return own_arena(layout, device)
    if kind not in ARENAS:
        raise ValueError(f"no peer arena for transport {kind!r}; the device P2P forward runs over {', '.join(ARENAS)}")
    if group is None:
        raise ValueError(f"MEGA_DISPATCH={kind}: ep_size {layout.ep} needs a process group (group=None given)")
    return ARENAS[kind](layout, group, device)


def _cuda_handle(t: torch.Tensor) -> bytes:
    """A picklable CUDA IPC handle of ``t`` (torch.multiprocessing's own reduction)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(t)
    return buf.getvalue()


def _open(handle, device: torch.device) -> torch.Tensor:
    if isinstance(handle, str):
        return torch.from_file(handle, shared=True, size=os.path.getsize(handle), dtype=torch.uint8)
    import torch.multiprocessing as _registers_cuda_reductions  # noqa: F401

    with torch.cuda.device(device):
        return pickle.loads(handle)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
