"""The peer-arena handshake: prove at start-up that every rank can write every peer's arena.

Why: mapping a peer's arena (CUDA IPC handle, symmetric-memory rendezvous) can succeed while
writes through it never arrive (no peer access, a rank on another host, a stuck peer). The device
P2P forward would then wait MEGA_P2P_TIMEOUT_S in its first barrier, inside a captured graph. So
before the arena serves: each rank writes a token into its slot of every peer's header region,
then reads its own header until every peer's token is there or MEGA_P2P_TIMEOUT_S passed, and the
ranks share what they saw (one host-side all_gather over the EP group), so they all agree: either
every rank goes on, or every rank fails naming the ranks that did not answer. The header region
is rewritten by every dispatch before it is read; it is zeroed again after a passed handshake
anyway, so the arena serves from the state it was built in.

``probe_peer_arenas`` runs it on a tiny arena of a transport MEGA_DISPATCH=auto is about to pick
(layer/ep_transport.py): a failed probe (the arena's set-up or the handshake, on any rank) makes
auto fall back to nccl on every rank instead of failing the start.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .base import TransportError
from .peer_arena import ALIGN, ArenaLayout, PeerArena, make_arena

TOKEN_BASE = 0x4D656761 << 32  # "Mega" in the high half: a value a zeroed arena never holds
POLL_S = 0.002


class HandshakeError(TransportError):
    """Some rank's token did not reach some peer's arena within MEGA_P2P_TIMEOUT_S."""


def token(rank: int) -> int:
    return TOKEN_BASE + rank


def _header(arena: PeerArena, buffer: torch.Tensor) -> torch.Tensor:
    lay = arena.layout
    return buffer[lay.header : lay.header + 8 * lay.ep].view(torch.int64)


def send_tokens(arena: PeerArena) -> None:
    """Write this rank's token into its header slot of every rank's arena (its own included)."""
    me = arena.rank
    mine = torch.full((1,), token(me), dtype=torch.int64, device=arena.local.device)
    for r in range(arena.ep):
        _header(arena, arena.peer_bytes(r))[me : me + 1].copy_(mine)
    if arena.local.device.type == "cuda":
        torch.cuda.synchronize(arena.local.device)  # the writes have landed before the peers look


def await_tokens(arena: PeerArena, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> list[int]:
    """The ranks whose token is not in this rank's arena once every token arrived or ``timeout_s`` passed."""
    header = _header(arena, arena.local)
    expected = [token(s) for s in range(arena.ep)]
    deadline = clock() + timeout_s
    while True:
        seen = header.tolist()
        missing = [s for s in range(arena.ep) if seen[s] != expected[s]]
        if not missing or clock() >= deadline:
            return missing
        time.sleep(POLL_S)


def agree(arena: PeerArena, missing: list[int], group, timeout_s: float) -> None:
    """Share every rank's missing list over ``group``; raise the same HandshakeError on every rank if
    any is not empty. (Bounded by the process group's own timeout, as every start-up collective.)"""
    import torch.distributed as dist

    every: list = [None] * arena.ep
    dist.all_gather_object(every, missing, group=group)
    failed = {rank: m for rank, m in enumerate(every) if m}
    if not failed:
        return
    silent = sorted(set().union(*failed.values()))
    seen_by = "; ".join(f"ep_rank {rank} got no token from ep_rank {m}" for rank, m in sorted(failed.items()))
    raise HandshakeError(
        f"[megamoe] MEGA_DISPATCH={arena.name}: peer-arena handshake failed, ep_rank(s) {silent} did not answer within "
        f"MEGA_P2P_TIMEOUT_S={timeout_s:g}s ({seen_by}): a rank that cannot write its peers' arenas (no CUDA peer "
        "access, another host) or that is stuck. Use MEGA_DISPATCH=nccl, or fix the peer access."
    )


def handshake(arena: PeerArena, group, timeout_s: float) -> None:
    """The whole handshake (module docstring); every rank of ``group`` calls it after building its arena."""
    send_tokens(arena)
    agree(arena, await_tokens(arena, timeout_s), group, timeout_s)
    # everyone passed agree(): every write has landed, so clearing this rank's header races nothing
    _header(arena, arena.local).zero_()
    if arena.local.device.type == "cuda":
        torch.cuda.synchronize(arena.local.device)


def probe_peer_arenas(kind: str, group, device: torch.device, timeout_s: float) -> str | None:
    """Build a tiny ``kind`` arena over ``group`` and handshake on it: None when it passed, else why not.

    Every failure is agreed before it is reported: the arena's set-up steps end in
    ``agree_on_setup`` (peer_arena.py) and the handshake in ``agree``, so every rank returns the same
    answer, naming the rank(s) that failed and why, and no rank waits on another's failed set-up."""
    import torch.distributed as dist

    layout = ArenaLayout.build(dist.get_world_size(group), 1, 1, ALIGN, ALIGN)
    try:
        handshake(make_arena(kind, layout, group, device), group, timeout_s)
    except TransportError as exc:
        return str(exc)
    return None
