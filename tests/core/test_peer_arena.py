"""Peer arenas (transport/peer_arena.py) on CPU gloo ranks, and the P2P forward's host-side refusals.

The IPC arena's CPU form (a shared-memory file per rank, mapped by every rank) is what the
interpreter tests run the P2P kernels on; here: its layout, that a write through a peer offset lands
in that peer's arena (seen by the peer process), the start-up handshake (transport/handshake.py:
passes, or fails on every rank naming the rank that did not answer, within MEGA_P2P_TIMEOUT_S), the
EP topology gathered over the group, and the clear errors around MEGA_DISPATCH=ipc.
"""

from __future__ import annotations

import time
import types

import pytest
import torch

from megamoe_backend.knobs import Knobs
from megamoe_backend.layer import MegaMoELayer
from megamoe_backend.parallel.spawn import spawn_ranks
from megamoe_backend.plan import build_plan
from megamoe_backend.spec import preset
from megamoe_backend.transport.handshake import (
    HandshakeError,
    agree,
    await_tokens,
    handshake,
    probe_peer_arenas,
    token,
)
from megamoe_backend.transport.peer_arena import ALIGN, ArenaLayout, make_arena
from megamoe_backend.workload import ProblemConfig, make_problem
from megamoe_backend.workload.problem import local_weights

SPEC = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8)


def test_layout_regions_are_aligned_disjoint_and_sized_by_the_plan():
    lay = ArenaLayout.build(ep=4, mtpr=16, topk=6, row_bytes=128 + 4, comb_bytes=256)
    regions = [(lay.flags, 2 * 4 * 8), (lay.header, 4 * 8), (lay.recv_rows, 4 * 16 * 132), (lay.recv_slot, 4 * 16 * 6 * 8),
               (lay.recv_weight, 4 * 16 * 6 * 4), (lay.combine, 16 * 6 * 256)]
    for (start, size), (nxt, _) in zip(regions, regions[1:] + [(lay.total, 0)]):
        assert start % ALIGN == 0 and start + size <= nxt
    assert lay.total % ALIGN == 0


def _exchange(rank, world):
    import torch.distributed as dist

    lay = ArenaLayout.build(world, 4, 2, 64, 64)
    arena = make_arena("ipc", lay, dist.group.WORLD, torch.device("cpu"))
    offsets = arena.peer_offsets.tolist()
    # write my rank into byte `rank` of every peer's combine region, through the offsets only
    base = arena.local.data_ptr()
    for r, off in enumerate(offsets):
        view = arena._peers[r]  # the mapping of rank r's arena in this process: local + offset[r]
        assert view.data_ptr() == base + off
        view[lay.combine + rank] = 10 + rank
    dist.barrier()
    seen = arena.local[lay.combine : lay.combine + world].tolist()
    return {"offsets": offsets, "seen": seen, "name": arena.name}


@pytest.mark.parametrize("world", [2, 3])
def test_ipc_arena_on_cpu_is_shared_between_rank_processes(world):
    results = spawn_ranks(world, _exchange)
    for rank, r in enumerate(results):
        assert r["name"] == "ipc" and r["offsets"][rank] == 0
        assert r["seen"] == [10 + s for s in range(world)]  # every peer's write reached this rank's arena


def _handshake_worker(rank, world, silent):
    """Every rank builds its arena and shakes hands; rank ``silent`` never writes its token."""
    import torch.distributed as dist

    from megamoe_backend.platform.topology import gather_ep_topology

    lay = ArenaLayout.build(world, 4, 2, 64, 64)
    arena = make_arena("ipc", lay, dist.group.WORLD, torch.device("cpu"))
    header = arena.local[lay.header : lay.header + 8 * world].view(torch.int64)
    start = time.monotonic()
    try:
        if rank == silent:  # a rank whose writes never land: it takes part in the agreement only
            agree(arena, await_tokens(arena, 1.0), dist.group.WORLD, 1.0)
        else:
            handshake(arena, dist.group.WORLD, 1.0)
        error = None
    except HandshakeError as exc:
        error = str(exc)
    topology = gather_ep_topology(dist.group.WORLD, torch.device("cpu"))
    return {"error": error, "seconds": time.monotonic() - start, "header": header.tolist(),
            "probe": probe_peer_arenas("ipc", dist.group.WORLD, torch.device("cpu"), 5.0) if silent is None else None,
            "hosts": len(topology.hosts), "places": len(topology.ranks)}


@pytest.mark.parametrize("world", [2, 3])
def test_handshake_passes_and_leaves_the_header_as_built(world):
    results = spawn_ranks(world, _handshake_worker, None)
    for r in results:
        assert r["error"] is None and r["probe"] is None, r
        assert r["header"] == [0] * world  # zeroed again: the arena serves from the state it was built in
        assert r["seconds"] < 1.0  # every token was there: no wait for the deadline
        assert (r["hosts"], r["places"]) == (1, world)  # gathered over the group: one host


def test_a_rank_that_does_not_answer_fails_the_handshake_on_every_rank():
    results = spawn_ranks(3, _handshake_worker, 2)
    for rank, r in enumerate(results):
        assert r["error"] is not None and "peer-arena handshake failed, ep_rank(s) [2] did not answer" in r["error"], r
        assert "MEGA_P2P_TIMEOUT_S=1s" in r["error"] and "MEGA_DISPATCH=nccl" in r["error"]
        assert "ep_rank 0 got no token from ep_rank [2]" in r["error"], r  # every rank reports what every rank saw
        assert 1.0 <= r["seconds"] < 5.0, r  # bounded by MEGA_P2P_TIMEOUT_S (plus the agreement)
    assert results[0]["header"][:2] == [token(0), token(1)]  # what did arrive, arrived


@pytest.mark.parametrize("name", ["ipc", "symm"])  # symm: the eager symmetric-memory transport is gone (issue 46)
def test_ipc_needs_the_device_forward(name):
    problem = make_problem(ProblemConfig(SPEC, 2, 2, seed=1))
    knobs = Knobs(transport=name)
    plan = build_plan(SPEC, knobs, 0, 2, quant="bf16", backends=("torch", name))
    with pytest.raises(ValueError, match=f"MEGA_DISPATCH={name} is the device P2P forward: it needs CUDA and the triton experts"):
        MegaMoELayer(plan, local_weights(problem.expert_weights("bf16"), plan.placement, 0), group=object())
    with pytest.raises(ValueError, match="needs a process group"):
        make_arena("ipc", ArenaLayout.build(2, 4, 2, 64, 64), None, torch.device("cpu"))


# ---- a failed arena set-up on ONE rank: gathered, the same answer on every rank (issue 44) --------------

def _failing_setup_worker(rank, world, step, bad_rank):
    """Every rank probes an ipc arena; on ``bad_rank`` the set-up ``step`` raises (alloc: creating the
    shared-memory file; open: mapping a peer's arena). Then the whole of auto's decision with the
    real probe, the places gathered for real (every rank put on one GPU: the rule picks ipc)."""
    import logging

    import torch.distributed as dist

    from megamoe_backend.layer.ep_transport import decide_ep_transport
    from megamoe_backend.platform.topology import EpTopology, gather_ep_topology
    from megamoe_backend.transport import peer_arena

    def broken(*args, **kwargs):
        if step == "alloc":
            raise OSError("injected: no space left on /dev/shm")
        raise RuntimeError("injected: cudaIpcOpenMemHandle failed (invalid device context)")

    if rank == bad_rank:  # this process only (spawned): nothing to restore
        if step == "alloc":
            peer_arena.torch = types.SimpleNamespace(**{**vars(torch), "from_file": broken})
        else:
            peer_arena._open = broken
    group, cpu = dist.group.WORLD, torch.device("cpu")
    start = time.monotonic()
    probe = probe_peer_arenas("ipc", group, cpu, 5.0)
    seconds = time.monotonic() - start
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("megamoe").addHandler(handler)

    def one_gpu(g, d):
        return EpTopology(tuple(type(p)(p.host, "g0", ("g0",), False) for p in gather_ep_topology(g, d).ranks))

    spec = SPEC.scaled(n_routed_experts=12)
    pending = build_plan(spec, Knobs(), rank, world, quant="bf16", backends=("triton", "nccl"))
    choice = decide_ep_transport(pending, group, cpu, gather=one_gpu)
    return {"probe": probe, "seconds": seconds, "choice": (choice.transport, choice.why), "lines": lines}


@pytest.mark.parametrize("step, words", [("alloc", "allocating its arena failed on 1 of 3 rank(s) (ep_rank 1: OSError: "
                                                   "injected: no space left on /dev/shm)"),
                                         ("open", "opening its peers' arenas failed on 1 of 3 rank(s) (ep_rank 2: "
                                                  "RuntimeError: injected: cudaIpcOpenMemHandle failed")])
def test_a_set_up_that_fails_on_one_rank_means_nccl_on_every_rank(step, words):
    """Mutation run once (2026-12-04, the peer_arena.py of 2377c6c, whose failing rank raised alone):
    the "open" case fails, the three ranks come back with three different answers (rank 2 its own
    error, rank 0 a shared-memory file already gone), so auto could not agree on a transport."""
    bad = 1 if step == "alloc" else 2
    results = spawn_ranks(3, _failing_setup_worker, step, bad, timeout_s=120)
    answers = {r["probe"] for r in results}
    assert len(answers) == 1, answers  # every rank got the same answer
    assert words in answers.pop()
    for rank, r in enumerate(results):
        assert r["seconds"] < 5.0, r  # nobody waited for a deadline: the failure was agreed at once
        transport, why = r["choice"]
        assert transport == "nccl" and "peer-arena handshake over ipc failed, so nccl (eager)" in why and words in why
        assert any(f"ep_rank {rank}: transport nccl (MEGA_DISPATCH=auto)" in line and words in line for line in r["lines"])


def _symm_probe_worker(rank, world):
    import torch.distributed as dist

    return probe_peer_arenas("symm", dist.group.WORLD, torch.device("cpu"), 2.0)


def test_a_symm_rendezvous_that_cannot_run_is_one_agreed_answer():
    """CPU ranks: torch's symmetric memory refuses the device on every rank; the probe returns, on
    both, the one message naming both ranks (before issue 44 the SymmPeerArena raised past the probe)."""
    answers = spawn_ranks(2, _symm_probe_worker, timeout_s=120)
    assert answers[0] == answers[1] and "allocating symmetric memory failed on 2 of 2 rank(s)" in answers[0]
    assert "ep_rank 0: RuntimeError" in answers[0] and "ep_rank 1: RuntimeError" in answers[0]
