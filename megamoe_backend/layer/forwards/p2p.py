"""The device P2P forward across EP ranks (MEGA_DISPATCH=symm | ipc, or the one-process emulator):

    dispatch (quantise once, write into the owners' arenas, header: rows per source B, tokens T)
    -> barrier -> the experts on the live rows of the receive region (GEMM2 writing each row into
    its source rank's combine region) -> barrier -> top-k sum of this rank's combine region

Every rank runs it, also with 0 tokens; nothing reads the device or sizes a buffer by the data.
The receive region holds ep x B rows, B = ``max_tokens_across_ranks`` (the engine's DP-padded
bound, the same on every rank) or MEGA_MAX_TOKENS_PER_RANK; the experts walk only the T_s rows
each source sent (experts/live.py), so a step costs its live rows, whatever B is. The tile config
follows B when the engine passed it, else it is picked on the device from the live pair count.

``steps`` is the forward as a generator that stops after each launch group a peer must see and
hands each barrier to its driver (``PeerBarrier``): ``run_steps`` launches it whole; a driver of
several ranks on one stream (the one-process emulator, benchmarks/emulated_ep.py, which the P2P
forward's interpreter tests run on) launches every rank's signal before any rank's wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...experts import ExpertPairs
from ...experts.live import LiveRows, SegmentDest
from ...plan.token_bound import bound_problem
from ...transport import PeerInputError, PeerTimeoutError
from .base import capturing
from .device import WorkspaceForward


class P2PForward(WorkspaceForward):
    def __init__(self, layer, group) -> None:
        from ..device.workspace import P2PWorkspace

        plan = layer.plan
        super().__init__(layer, group, lambda: P2PWorkspace(plan, group, layer.device, plan.knobs.p2p_timeout_s))

    @property
    def name(self) -> str:
        ws = self.workspace
        kind = ws.arena.name if ws is not None else self.plan.backends.transport
        return f"device p2p over {kind}"

    def __call__(self, x, topk_ids, topk_weights, output_scale, out, max_tokens_across_ranks):
        return run_steps(self.steps(x, topk_ids, topk_weights, output_scale, out, max_tokens_across_ranks))

    def rows_per_source(self, t: int, max_tokens_across_ranks: int | None) -> int:
        """B: the bound the engine passed (checked), else MEGA_MAX_TOKENS_PER_RANK."""
        mtpr = self.plan.mtpr
        problem = bound_problem(t, max_tokens_across_ranks, mtpr)
        if problem:
            raise PeerInputError(f"[megamoe] {self.layer_name}: {problem}")
        return mtpr if max_tokens_across_ranks is None else int(max_tokens_across_ranks)

    def steps(self, x, topk_ids, topk_weights, output_scale: float = 1.0, out=None, max_tokens_across_ranks=None):
        """The forward, yielding after the dispatch and after the experts, and barrier 0 / 1 as a
        ``PeerBarrier`` for the driver to launch; the last step (top-k sum) returns the result (the
        generator's return value: run_steps). Host checks run before the first launch."""
        from ..device.p2p import dispatch
        from ..device.topk_sum import topk_sum

        plan, ws = self.plan, self.workspace
        if ws.broken:
            raise PeerTimeoutError(ws.broken)
        self.begin(x, topk_ids, topk_weights)
        t, k, hidden = x.shape[0], plan.topk, plan.hidden
        rows = self.rows_per_source(t, max_tokens_across_ranks)
        n_recv = plan.ep_size * rows
        n_pairs = n_recv * k
        live = LiveRows(ws.recv_tokens, rows, config_pairs=None if max_tokens_across_ranks is None else rows * k)
        budget = self._wait_budget(self.provider.kernel_key(self.weights, n_pairs, live, self.device))
        out = self.output(t, out)
        word, index = ws.status.word, self.status_index

        dispatch(x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), self.owner, self.slot, rows, ws.arena,
                 ws.wire.mx or "bf16", hidden, ws.pair_live, word, index)
        yield "dispatch"
        yield self._barrier(0, rows, budget)
        pairs = ExpertPairs(row=ws.pair_row[:n_pairs], slot=ws.recv_slot[:n_pairs], weight=ws.recv_weight[:n_pairs],
                            per_row=k)
        # GEMM2 writes each received pair's row into its source rank's combine region
        dest = SegmentDest(ws.combine_base, rows * k, ws.layout.comb_bytes, align=ws.combine_align)
        self.provider.forward_wire(ws.wire.view(ws.recv_rows[:n_recv], hidden), pairs, self.weights, plan.math, plan.combine,
                                   out=ws.arena.local, dest=dest, live=live,
                                   scratch=ws.scratch)
        yield "experts"
        yield self._barrier(1, rows, budget)
        if t:
            topk_sum(ws.combine_rows[: t * k], ws.pair_live[: t * k], out, plan.combine.mx, hidden, k, word, index,
                     output_scale)
        ws.status.publish()
        ws.forwards_done += 1
        return out

    def _wait_budget(self, kernel_key) -> int:
        """This forward's bound on each peer wait (device units): the start-up one or MEGA_P2P_TIMEOUT_S's.
        ``kernel_key``: the experts provider's for this forward (ExpertsProvider.kernel_key); a key the
        workspace has not launched before may compile kernels on every rank (startup_wait.py)."""
        from ..device.startup_wait import WaitFacts, takes_startup_bound

        ws = self.workspace
        capturing_now = capturing(self.device)
        new_kernels = kernel_key is not None and kernel_key not in ws.kernel_keys
        facts = WaitFacts(capturing_now, ws.forwards_done, self.plan.engine_graphs == "captured", ws.captured_before,
                          new_kernels)
        ws.captured_before = ws.captured_before or capturing_now
        if kernel_key is not None:
            ws.kernel_keys.add(kernel_key)
        return ws.startup_budget if takes_startup_bound(facts) else ws.budget

    def _barrier(self, phase: int, rows: int, budget: int) -> "PeerBarrier":
        ws = self.workspace
        return PeerBarrier(phase, (ws.arena, ws.epochs, phase, budget, rows, ws.status.word, self.status_index))


@dataclass(frozen=True)
class PeerBarrier:
    """Barrier ``phase`` of one rank's forward (its launch arguments), launched by the driver of the
    steps. Why the driver: ``run_steps`` launches signal and wait as one kernel, while ranks sharing
    one stream (the one-process emulator) need every rank's signal launched before any rank's wait:
    a wait queued ahead of the signal it waits for would never end."""

    phase: int
    args: tuple

    def launch(self, signal: bool = True, wait: bool = True) -> None:
        from ..device.p2p import barrier

        barrier(*self.args, signal=signal, wait=wait)


def run_steps(steps) -> torch.Tensor:
    """Run a ``P2PForward.steps`` generator to its end, each barrier launched whole; return its result."""
    while True:
        try:
            step = next(steps)
        except StopIteration as done:
            return done.value
        if isinstance(step, PeerBarrier):
            step.launch()
