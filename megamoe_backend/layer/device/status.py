"""The input status word: how data-dependent checks report without a host synchronisation.

Why: an out-of-range expert id or a NaN row can only be seen by reading the data, and reading it
on the host (``.any()``, ``.item()``) stalls the stream and cannot be captured in a CUDA graph. So
the kernels that touch the data check it themselves and record the first problem in a small
device tensor; every forward then copies that word, without blocking, into pinned host memory,
and the host reads the copy at the start of the next forward (or when an engine calls
``raise_if_bad``). Nothing waits: the host sees what the GPU has finished, which in an engine that
reads its sampled tokens every step is every earlier step.

The word is sticky (first problem wins, later ones are not recorded) until the host raises, which
clears it. Layout, int64 [4]: (code, layer_id, value, row).
"""

from __future__ import annotations

import torch

from ...transport.base import PeerTimeoutError, TransportError

OK = 0
BAD_EXPERT_ID = 2  # same number as the transports' status 2 ("expert id out of range")
NONFINITE_ROW = 4
NONFINITE_INPUT = 5
PEER_TIMEOUT = 6  # the device P2P forward waited for a peer past MEGA_P2P_TIMEOUT_S (value: that peer, row: phase)
ROWS_MISMATCH = 7  # a peer assumed another number of rows per source (value: its number, row: that peer)

PHASES = {0: "dispatch (its token rows)", 1: "combine (its expert rows)"}

WORDS = 4


class InputStatus:
    """One status word per device workspace (shared by every layer of that shape)."""

    def __init__(self, device: torch.device, num_physical: int, rank: int = 0, timeout_s: float | None = None) -> None:
        self.device = torch.device(device)
        self.num_physical = num_physical
        self.rank, self.timeout_s = rank, timeout_s  # for the P2P forward's messages
        self.word = torch.zeros(WORDS, dtype=torch.int64, device=self.device)
        pin = self.device.type == "cuda"
        self.host = torch.zeros(WORDS, dtype=torch.int64, pin_memory=pin)

    def publish(self) -> None:
        """Enqueue the copy of the device word into host memory (no wait; capturable: pinned memory)."""
        self.host.copy_(self.word, non_blocking=self.device.type == "cuda")

    def code(self) -> int:
        """What the host copy says now (a plain host read)."""
        return int(self.host[0])

    def raise_if_bad(self, layer_names: dict[int, str] | None = None) -> None:
        """Raise the recorded problem (and clear it) if the host copy holds one; else return at once."""
        if self.code() == OK:
            return
        if self.device.type == "cuda":
            # Only on the error path: make sure the copy is whole before reading its details.
            torch.cuda.current_stream(self.device).synchronize()
        code, layer, value, row = (int(v) for v in self.host.tolist())
        self.word.zero_()
        self.host.zero_()
        where = (layer_names or {}).get(layer, f"layer {layer}")
        if code == BAD_EXPERT_ID:
            raise ValueError(
                f"[megamoe] {where}: topk_ids holds {value} at token {row}; valid are -1 (masked) and "
                f"0..{self.num_physical - 1}. That entry contributed nothing; no other token was touched."
            )
        if code == NONFINITE_ROW:
            raise ValueError(
                f"[megamoe] {where}: output row {row} is not finite (NaN/Inf in hidden_states row {row}, or "
                "an overflow in its experts); other rows are unaffected."
            )
        if code == NONFINITE_INPUT:
            raise ValueError(
                f"[megamoe] {where}: hidden_states row {row} holds NaN/Inf (found while quantising it); "
                "its output row is not meaningful, other rows are unaffected."
            )
        if code == PEER_TIMEOUT:
            raise PeerTimeoutError(
                f"[megamoe] {where}: ep_rank {self.rank} waited more than MEGA_P2P_TIMEOUT_S={self.timeout_s:g}s for ep_rank "
                f"{value} at the {PHASES.get(row, f'phase {row}')} barrier: that peer died, hangs or runs another step. "
                "This forward's output is not valid; the EP group cannot continue (restart the engine)."
            )
        if code == ROWS_MISMATCH:
            raise TransportError(
                f"[megamoe] {where}: ep_rank {row} dispatched {value} rows per source, this rank (ep_rank {self.rank}) "
                "expected another number: every rank must pass the same max_tokens_across_ranks to the same forward. "
                "This forward's output is not valid."
            )
        raise ValueError(f"[megamoe] {where}: input status word {code} (value {value}, row {row})")
