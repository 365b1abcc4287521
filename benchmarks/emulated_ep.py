"""N EP ranks of one layer in ONE process on one device: the same P2P forward, kernels and
destination maps as ``MEGA_DISPATCH=ipc | symm``, the ranks' arenas in one allocation.

Why: ranks as processes on one GPU time-slice it (each barrier waits for the other contexts'
slices), so their times say nothing about one rank on its own GPU. Here each rank's steps are
launched in turn on one stream — every rank's dispatch, every rank's barrier signal, every rank's
barrier wait and experts, ... (P2PForward.steps hands each barrier to this driver) — so nothing waits
on anything but the stream, and events around a rank's launches give that rank's kernel time. What the
emulator cannot give, NVLink time and barrier latency between GPUs, the bench adds as a stated
model (bench_layer_emulated.py). It also serves tests: EP forwards in one process
(tests/kernels/test_live_interpreter.py, test_gpu_emulated.py).

The layer reaches these arenas through its group: an ``EmulatedGroup`` brings its own
(``peer_arena``, which transport/peer_arena.make_arena asks a group for before any transport's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megamoe_backend.experts import ExpertsProvider, ExpertWeights
from megamoe_backend.layer import MegaMoELayer
from megamoe_backend.layer.forwards import P2PForward
from megamoe_backend.layer.forwards.p2p import PeerBarrier
from megamoe_backend.plan import LayerPlan
from megamoe_backend.transport import TransportError
from megamoe_backend.transport.peer_arena import ArenaLayout, PeerArena


def _indexed(device: torch.device) -> torch.device:
    """"cuda" -> "cuda:N" (the current device), as tensors report it; other devices as they are."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class EmulatedRanks:
    """N EP ranks in one process: one allocation holds every rank's arena (made by the first arena
    built), so peers are offsets into it, as they are across processes."""

    def __init__(self, ep: int, device: torch.device) -> None:
        self.ep, self.device = ep, _indexed(torch.device(device))
        self.buffer: torch.Tensor | None = None
        self.layout: ArenaLayout | None = None
        # held for the world's lifetime: the workspace cache keys on a group's identity (id), which
        # must not be reused by another rank's group
        self._groups = [EmulatedGroup(self, r) for r in range(ep)]

    def group(self, rank: int) -> "EmulatedGroup":
        if not 0 <= rank < self.ep:
            raise ValueError(f"emulated rank {rank} outside [0, {self.ep})")
        return self._groups[rank]

    def arenas(self, layout: ArenaLayout) -> torch.Tensor:
        if self.buffer is None:
            self.buffer, self.layout = torch.zeros(self.ep * layout.total, dtype=torch.uint8, device=self.device), layout
        elif layout != self.layout:
            raise TransportError(f"[megamoe] emulated ranks share one arena layout; got {layout} after {self.layout}")
        return self.buffer


@dataclass(frozen=True, eq=False)
class EmulatedGroup:
    """Stands in for rank ``rank``'s process group (the workspace cache keys on its identity)."""

    world: EmulatedRanks
    rank: int

    def peer_arena(self, layout: ArenaLayout, device: torch.device) -> "EmulatedPeerArena":
        """This rank's arena whatever transport the plan names (the bench plans with ipc; the kernels are the same)."""
        return EmulatedPeerArena(layout, self, device)


class EmulatedPeerArena(PeerArena):
    name = "emulated"
    needs_handshake = False  # every rank's arena is a slice of one allocation of this process

    def __init__(self, layout: ArenaLayout, group: EmulatedGroup, device: torch.device) -> None:
        world = group.world
        if world.ep != layout.ep:
            raise TransportError(f"[megamoe] {world.ep} emulated ranks, the plan has ep_size {layout.ep}")
        if _indexed(torch.device(device)) != world.device:
            raise TransportError(f"[megamoe] emulated ranks live on {world.device}, the layer on {device}")
        buf = world.arenas(layout)
        arenas = [buf[r * layout.total: (r + 1) * layout.total] for r in range(layout.ep)]
        super().__init__(layout, group.rank, arenas[group.rank], arenas)


class RankTimer:
    """CUDA events around every launch group of every rank: per-rank kernel µs of one forward."""

    def __init__(self, ep: int) -> None:
        self.spans: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = [[] for _ in range(ep)]

    def start(self, rank: int) -> None:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        self.spans[rank].append((begin, end))

    def stop(self, rank: int) -> None:
        self.spans[rank][-1][1].record()

    def rank_us(self) -> list[float]:
        """Per rank, the sum of its spans (call after a synchronize)."""
        return [sum(b.elapsed_time(e) for b, e in spans) * 1e3 for spans in self.spans]


class EmulatedEP:
    """``ep`` MegaMoELayers (rank r built from ``plan_for(r)`` and ``weights_for(r)``) on one device.

    ``share_scratch``: every rank's workspace takes rank 0's experts scratch (experts/scratch.py). Valid because
    the scratch lives only inside a rank's experts step (P2PForward.steps: ``forward_wire``) and the ranks' steps
    run in turn on one stream, as one set serves the 61 layers of one rank; on a GPU it holds one rank's
    intermediates instead of ``ep`` sets (humming's at EP 8 and MTPR 8192: 7.3 GB, not 58.5), and changes no
    rank's kernels or rows."""

    def __init__(self, ep: int, plan_for: Callable[[int], LayerPlan], weights_for: Callable[[int], ExpertWeights],
                 device: torch.device, provider_for: Callable[[int], ExpertsProvider] | None = None,
                 name: str = "layer 0", share_scratch: bool = False) -> None:
        self.ep, self.device = ep, torch.device(device)
        self.ranks = EmulatedRanks(ep, self.device)
        self.layers = []
        for r in range(ep):
            plan = plan_for(r)
            if plan.ep_size != ep or plan.ep_rank != r:
                raise ValueError(f"plan_for({r}) gave ep_rank {plan.ep_rank} of ep_size {plan.ep_size}, expected {r} of {ep}")
            layer = MegaMoELayer(plan, weights_for(r), group=self.ranks.group(r), device=self.device,
                                 provider=provider_for(r) if provider_for else None, device_path=True, name=name)
            if not isinstance(layer.path, P2PForward):
                raise ValueError(f"rank {r} did not take the device P2P forward ({layer.transport_name})")
            self.layers.append(layer)
        if share_scratch:
            for layer in self.layers[1:]:
                layer.workspace.scratch = self.layers[0].workspace.scratch

    def forward(self, inputs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                max_tokens_across_ranks: int | None = None, output_scale: float = 1.0,
                timer: RankTimer | None = None) -> list[torch.Tensor]:
        """Every rank's forward of its (x, topk_ids, topk_weights), steps interleaved across ranks: every
        rank's step i before any rank's step i + 1, a barrier as every rank's signal, then every rank's wait."""
        if len(inputs) != self.ep:
            raise ValueError(f"{len(inputs)} inputs for {self.ep} emulated ranks")
        steps = [layer.path.steps(x, ids, w, output_scale, None, max_tokens_across_ranks)
                 for layer, (x, ids, w) in zip(self.layers, inputs)]
        outs: list[torch.Tensor | None] = [None] * self.ep
        while any(o is None for o in outs):
            barriers: dict[int, PeerBarrier] = {}
            for r, step in enumerate(steps):
                if outs[r] is not None:
                    continue
                if timer:
                    timer.start(r)
                try:
                    got = next(step)
                except StopIteration as done:
                    outs[r] = done.value
                else:
                    if isinstance(got, PeerBarrier):
                        barriers[r] = got
                if timer:
                    timer.stop(r)
            for signal in (True, False):
                for r, barrier in barriers.items():
                    if timer:
                        timer.start(r)
                    barrier.launch(signal=signal, wait=not signal)
                    if timer:
                        timer.stop(r)
        return outs

    def raise_if_bad_input(self) -> None:
        for layer in self.layers:
            layer.raise_if_bad_input()
