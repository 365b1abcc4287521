"""The device workspace: every buffer a sync-free forward needs, sized once, shared by layers.

Why one object: a forward that allocates by the data (``nonzero``, concatenations) cannot run in a
CUDA graph and pays allocator work in every layer. The sizes here come from the plan alone, the
most a forward can carry: MEGA_MAX_TOKENS_PER_RANK tokens x top-k pairs (ep_size 1), with rows as
wide as the wires. All layers of one shape use the same workspace (through the documented cache in
transport/cache.py), one after the other on the stream, so 61 layers cost one set of buffers.

  token_rows   uint8 [MTPR, A row]            the tokens in the A operand's MX format, quantised once
                                              (the dispatch wire's rows; empty for bf16 activations)
  pair_row     int64 [MTPR * k]               constant: pair p = t * k + j reads token row t
  pair_slot    int64 [MTPR * k]               local expert slot of each pair, -1 = does not run here
  pair_weight  fp32  [MTPR * k]               its route weight (0 where slot is -1)
  combine_rows uint8 [MTPR * k, combine row]  what GEMM2's epilogue writes, one row per pair
  status       InputStatus                    data checks reported without a host sync
  scratch      ExpertsScratch                 the experts' intermediates (experts/scratch.py), sized
                                              at capacity by the first forward, then reused

``P2PWorkspace`` is the same for ep_size > 1 (layer/device/p2p.py): the token rows travel into the
owners' arenas (transport/peer_arena.py), the combine rows come back into this rank's.
"""

from __future__ import annotations

import math

import torch

from ...experts.scratch import ExpertsScratch
from ...formats.wire import a_format_wire
from ...plan import LayerPlan
from .status import InputStatus


Shape = tuple[tuple[int, ...], torch.dtype]


def device_buffers(plan: LayerPlan) -> dict[str, Shape]:
    """The ep_size-1 workspace's buffers, name -> (shape, dtype), from the plan alone: what
    ``DeviceWorkspace`` allocates, and what ``megamoe info`` reports (layer/memory.py) without a GPU."""
    pairs = plan.mtpr * plan.topk
    a_format = plan.math.a_format  # fp8 | fp4 | fp8_g128 | None; a quantised dispatch wire equals it (plan check)
    a_bytes = a_format_wire(a_format).row_bytes(plan.hidden) if a_format else 0
    return {
        "token_rows": ((plan.mtpr if a_bytes else 0, a_bytes), torch.uint8),
        "pair_row": ((pairs,), torch.int64),
        "pair_slot": ((pairs,), torch.int64),
        "pair_weight": ((pairs,), torch.float32),
        "combine_rows": ((pairs, plan.combine.row_bytes(plan.hidden)), torch.uint8),
    }


def p2p_arena_layout(plan: LayerPlan):
    """The peer arena of the device P2P forward (ep_size > 1): the A operand's rows travel (bf16, or fp8 /
    fp4 MX or block-FP8's fp8_g128 quantised once by the sender), GEMM2's rows come back in the combine wire."""
    from ...transport.peer_arena import ArenaLayout

    row_bytes = a_format_wire(plan.math.a_format).row_bytes(plan.hidden)
    return ArenaLayout.build(plan.ep_size, plan.mtpr, plan.topk, row_bytes, plan.combine.row_bytes(plan.hidden))


def p2p_buffers(plan: LayerPlan) -> dict[str, Shape]:
    """The P2P workspace's buffers outside the arena, name -> (shape, dtype)."""
    return {
        "pair_row": ((plan.ep_size * plan.mtpr * plan.topk,), torch.int64),
        "pair_live": ((plan.mtpr * plan.topk,), torch.int64),
        "epochs": ((2,), torch.int64),
    }


def buffers_bytes(buffers: dict[str, Shape]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in buffers.values())


class _Workspace:
    """What both workspaces hold: the status word and the names of the layers that report into it."""

    def __init__(self, plan: LayerPlan, device: torch.device) -> None:
        self.device = torch.device(device)
        self.mtpr, self.topk, self.hidden = plan.mtpr, plan.topk, plan.hidden
        self.layer_names: dict[int, str] = {}
        self.broken: str | None = None  # P2P only: the message once a peer timed out (the group cannot go on)
        # the experts' intermediates (layout, A re-scaled, A2), allocated at capacity by the first forward
        self.scratch = ExpertsScratch(self.device)

    def _make_status(self, plan: LayerPlan, rank: int = 0, timeout_s: float | None = None) -> InputStatus:
        """The status word, naming this workspace's layers; on CUDA the process's watchdog polls it
        (watchdog.py: graph replays run no eager check)."""
        status = InputStatus(self.device, plan.placement.num_physical, rank=rank, timeout_s=timeout_s,
                             layer_names=self.layer_names, on_peer_timeout=plan.knobs.on_peer_timeout)
        if status.device.type == "cuda":
            from .watchdog import watch

            watch(status)
        return status

    def register_layer(self, name: str) -> int:
        """A small id for the status word, so an error names the layer that saw the bad input."""
        index = len(self.layer_names)
        self.layer_names[index] = name
        return index


class DeviceWorkspace(_Workspace):
    def __init__(self, plan: LayerPlan, device: torch.device) -> None:
        super().__init__(plan, device)
        self.a_format = plan.math.a_format
        shapes, dev = device_buffers(plan), self.device
        self.token_rows = torch.empty(shapes["token_rows"][0], dtype=torch.uint8, device=dev)
        self.pair_row = torch.arange(shapes["pair_row"][0][0], dtype=torch.int64, device=dev) // self.topk
        self.pair_slot = torch.full(shapes["pair_slot"][0], -1, dtype=torch.int64, device=dev)
        self.pair_weight = torch.zeros(shapes["pair_weight"][0], dtype=torch.float32, device=dev)
        self.combine_rows = torch.empty(shapes["combine_rows"][0], dtype=torch.uint8, device=dev)
        self.status = self._make_status(plan)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.token_rows, self.pair_row, self.pair_slot, self.pair_weight, self.combine_rows)) + self.scratch.bytes


class P2PWorkspace(_Workspace):
    """The device P2P forward's buffers (ep_size > 1), sized once from MTPR x top-k x ep and the wires.

      arena        PeerArena        recv rows / slots / weights, combine rows, barrier flags (peer_arena.py)
      pair_row     int64 [ep*MTPR*k] constant: received pair q reads received row q // k
      recv_tokens  int64 [ep]        view of the arena header: tokens each source sent this step (LiveRows)
      combine_base int64 [ep]        byte offset (from arena.local) of each source's combine region: GEMM2
                                     writes received pair q of source s at combine_base[s] + (q - s*B*k) * row
      pair_live    int64 [MTPR*k]    owner rank of each of this rank's pairs, -1 = runs nowhere
      epochs       int64 [2]         barriers passed per phase (the flags' next value)
    ``broken`` holds the message once a peer timed out: the group cannot continue after that.
    """

    def __init__(self, plan: LayerPlan, group, device: torch.device, timeout_s: float) -> None:
        from ...transport.handshake import handshake
        from ...transport.peer_arena import ALIGN, make_arena
        from .p2p import wait_budget

        super().__init__(plan, device)
        self.ep = plan.ep_size
        # what travels: the A operand's rows (bf16, or fp8 / fp4 MX or fp8_g128 quantised once by the sender),
        # whatever MEGA_DISPATCH_WIRE says: the bf16 wire's receiver quantisation gives the same bits
        self.wire = a_format_wire(plan.math.a_format)
        row_bytes = self.wire.row_bytes(self.hidden)
        self.layout = p2p_arena_layout(plan)
        self.arena = make_arena(plan.backends.transport, self.layout, group, self.device)
        if self.arena.needs_handshake:  # every peer can write this arena, or every rank fails naming who cannot
            handshake(self.arena, group, timeout_s)
        lay, pairs = self.layout, self.ep * self.mtpr * self.topk
        self.recv_rows = self.arena.view(lay.recv_rows, self.ep * self.mtpr * row_bytes, torch.uint8).view(-1, row_bytes)
        self.recv_slot = self.arena.view(lay.recv_slot, pairs, torch.int64)
        self.recv_weight = self.arena.view(lay.recv_weight, pairs, torch.float32)
        self.combine_rows = self.arena.view(lay.combine, self.mtpr * self.topk * lay.comb_bytes, torch.uint8).view(-1, lay.comb_bytes)
        shapes = p2p_buffers(plan)
        self.pair_row = torch.arange(shapes["pair_row"][0][0], dtype=torch.int64, device=self.device) // self.topk
        self.recv_tokens = self.arena.view(lay.header + self.ep * 8, self.ep, torch.int64)
        self.combine_base = self.arena.peer_offsets + lay.combine
        # every arena and region starts on ALIGN bytes (PeerArena checks the peers' offsets), so with the row
        # stride this is what GEMM2's destination may promise (SegmentDest.align: 16-byte vector stores)
        self.combine_align = math.gcd(ALIGN, lay.comb_bytes)
        self.pair_live = torch.full(shapes["pair_live"][0], -1, dtype=torch.int64, device=self.device)
        self.epochs = torch.zeros(shapes["epochs"][0], dtype=torch.int64, device=self.device)
        self.timeout_s = timeout_s
        self.budget = wait_budget(timeout_s, self.device)
        # start-up forwards wait longer (startup_wait.py); the counters below decide which those are
        startup_s = max(timeout_s, plan.knobs.p2p_startup_timeout_s)
        self.startup_budget = wait_budget(startup_s, self.device)
        self.forwards_done = 0
        self.captured_before = False
        self.kernel_keys: set = set()  # the experts' kernel keys this workspace's forwards launched (startup_wait.py)
        self.status = self._make_status(plan, rank=plan.ep_rank, timeout_s=timeout_s)

    @property
    def bytes(self) -> int:
        return (self.layout.total + sum(t.numel() * t.element_size() for t in (self.pair_row, self.pair_live))
                + self.scratch.bytes)
