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

OK = 0
BAD_EXPERT_ID = 2  # same number as the transports' status 2 ("expert id out of range")
NONFINITE_ROW = 4
NONFINITE_INPUT = 5

WORDS = 4


class InputStatus:
    """One status word per device workspace (shared by every layer of that shape)."""

    def __init__(self, device: torch.device, num_physical: int) -> None:
        self.device = torch.device(device)
        self.num_physical = num_physical
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
        raise ValueError(f"[megamoe] {where}: input status word {code} (value {value}, row {row})")
