"""N EP ranks of one layer in ONE process on one device: the same P2P forward, kernels and
destination maps as ``MEGA_DISPATCH=ipc | symm``, the ranks' arenas in one allocation
(transport/peer_arena.py EmulatedPeerArena).

Why: ranks as processes on one GPU time-slice it (each barrier waits for the other contexts'
slices), so their times say nothing about one rank on its own GPU. Here each rank's steps are
launched in turn on one stream — every rank's dispatch, every rank's barrier signal, every rank's
barrier wait and experts, ... (P2PForward.steps with split barriers) — so nothing waits on anything
but the stream, and events around a rank's launches give that rank's kernel time. What the
emulator cannot give, NVLink time and barrier latency between GPUs, the bench adds as a stated
model (bench/bench_layer_emulated.py). It also serves tests: EP forwards in one process.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..experts import ExpertsProvider, ExpertWeights
from ..plan import LayerPlan
from ..transport.peer_arena import EmulatedRanks


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
    """``ep`` MegaMoELayers (rank r built from ``plan_for(r)`` and ``weights_for(r)``) on one device."""

    def __init__(self, ep: int, plan_for: Callable[[int], LayerPlan], weights_for: Callable[[int], ExpertWeights],
                 device: torch.device, provider_for: Callable[[int], ExpertsProvider] | None = None,
                 name: str = "layer 0") -> None:
        from ..layer import MegaMoELayer
        from ..layer.forwards import P2PForward

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

    def forward(self, inputs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                max_tokens_across_ranks: int | None = None, output_scale: float = 1.0,
                timer: RankTimer | None = None) -> list[torch.Tensor]:
        """Every rank's forward of its (x, topk_ids, topk_weights), steps interleaved across ranks."""
        if len(inputs) != self.ep:
            raise ValueError(f"{len(inputs)} inputs for {self.ep} emulated ranks")
        steps = [layer.path.steps(x, ids, w, output_scale, None, max_tokens_across_ranks, split_barriers=True)
                 for layer, (x, ids, w) in zip(self.layers, inputs)]
        outs: list[torch.Tensor | None] = [None] * self.ep
        while any(o is None for o in outs):
            for r, step in enumerate(steps):
                if outs[r] is not None:
                    continue
                if timer:
                    timer.start(r)
                try:
                    next(step)
                except StopIteration as done:
                    outs[r] = done.value
                if timer:
                    timer.stop(r)
        return outs

    def raise_if_bad_input(self) -> None:
        for layer in self.layers:
            layer.raise_if_bad_input()
