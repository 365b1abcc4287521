"""Peer arenas (transport/peer_arena.py) on CPU gloo ranks, and the P2P forward's host-side refusals.

The IPC arena's CPU form (a shared-memory file per rank, mapped by every rank) is what the
interpreter tests run the P2P kernels on; here: its layout, that a write through a peer offset lands
in that peer's arena (seen by the peer process), and the clear errors around MEGA_DISPATCH=ipc.
"""

from __future__ import annotations

import pytest
import torch

from megamoe_backend.knobs import Knobs
from megamoe_backend.layer import MegaMoELayer
from megamoe_backend.parallel.spawn import spawn_ranks
from megamoe_backend.plan import build_plan
from megamoe_backend.spec import preset
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


def test_ipc_needs_the_device_forward():
    problem = make_problem(ProblemConfig(SPEC, 2, 2, seed=1))
    knobs = Knobs(transport="ipc")
    plan = build_plan(SPEC, knobs, 0, 2, quant="bf16", backends=("torch", "ipc"))
    with pytest.raises(ValueError, match="MEGA_DISPATCH=ipc is the device P2P forward: it needs CUDA and the triton experts"):
        MegaMoELayer(plan, local_weights(problem.expert_weights("bf16"), plan.placement, 0), group=object())
    with pytest.raises(ValueError, match="needs a process group"):
        make_arena("ipc", ArenaLayout.build(2, 4, 2, 64, 64), None, torch.device("cpu"))
