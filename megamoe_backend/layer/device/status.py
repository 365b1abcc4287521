"""The input status word: how data-dependent checks report without a host synchronisation.

Why: an out-of-range expert id or a NaN row can only be seen by reading the data, and reading it
on the host (``.any()``, ``.item()``) stalls the stream and cannot be captured in a CUDA graph. So
the kernels that touch the data check it themselves and record the first problem in a small
device tensor; every forward then copies that word, without blocking, into pinned host memory,
and the host reads the copy at the start of the next forward (or when an engine calls
``raise_if_bad``). Nothing waits: the host sees what the GPU has finished, which in an engine that
reads its sampled tokens every step is every earlier step.

The word is sticky (first problem wins, later ones are not recorded) until the host has reported
it. Graph replays run no Python, so a process-wide watchdog thread (watchdog.py) reads the host
copy every ~50 ms and reports what it finds; an eager forward still checks at its start. Each
problem is reported ONCE, by whichever of the two sees it first (``claim``), and then cleared in
stream order, never by the host racing a kernel: the reporter writes the problem's sequence
number into a pinned ``ack`` word, and every ``publish`` (also inside graphs) first copies ``ack``
to the device and clears the word if it still holds that problem (``clear_reported``), bumping the
sequence so the next problem is a new one.

Layout, int64 [6] on the device and (copied) in pinned host memory: (code, layer_id, value, row)
as the kernels record them (``word`` / ``host``: the first 4), then seq (the problem's number,
bumped by each clear) and the device copy of ack.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from ...transport.base import PeerTimeoutError, TransportError
from .process_end import end_process

OK = 0
BAD_EXPERT_ID = 2  # same number as the transports' status 2 ("expert id out of range")
NONFINITE_ROW = 4
NONFINITE_INPUT = 5
PEER_TIMEOUT = 6  # the device P2P forward waited for a peer past MEGA_P2P_TIMEOUT_S (value: that peer, row: phase)
ROWS_MISMATCH = 7  # a peer assumed another number of rows per source (value: its number, row: that peer)

PHASES = {0: "dispatch (its token rows)", 1: "combine (its expert rows)"}

WORDS = 4  # what the kernels record: (code, layer_id, value, row)
SEQ, ACK = WORDS, WORDS + 1  # behind them: the problem's sequence number, the device copy of ack
PROBLEMS = {BAD_EXPERT_ID: "bad_expert_id", NONFINITE_ROW: "nonfinite_row", NONFINITE_INPUT: "nonfinite_input",
            PEER_TIMEOUT: "peer_timeout", ROWS_MISMATCH: "rows_mismatch"}


class InputStatus:
    """One status word per device workspace (shared by every layer of that shape).

    ``layer_names`` (the workspace's, filled as layers register) names the layer in reports;
    ``on_peer_timeout`` is MEGA_ON_PEER_TIMEOUT: "exit" ends the process on a peer timeout
    (``end_process``, process_end.py), "raise" raises at the next eager check (the default of a bare
    status, as before the watchdog).
    """

    def __init__(self, device: torch.device, num_physical: int, rank: int = 0, timeout_s: float | None = None,
                 layer_names: dict[int, str] | None = None, on_peer_timeout: str = "raise") -> None:
        self.device = torch.device(device)
        self.num_physical = num_physical
        self.rank, self.timeout_s = rank, timeout_s  # for the P2P forward's messages
        self.layer_names = {} if layer_names is None else layer_names
        self.on_peer_timeout = on_peer_timeout
        pin = self.device.type == "cuda"
        self._words = torch.zeros(WORDS + 2, dtype=torch.int64, device=self.device)
        self._host_words = torch.zeros(WORDS + 2, dtype=torch.int64, pin_memory=pin)
        self.word, self.host = self._words[:WORDS], self._host_words[:WORDS]  # what kernels record / the host reads
        self._ack = torch.full((1,), -1, dtype=torch.int64, pin_memory=pin)  # the last reported problem's seq
        self._lock = threading.Lock()
        self._claimed = -1  # the highest seq reported so far (by the watchdog or an eager check)
        self.end_process: Callable[[str], None] | None = None  # None: process_end.end_process (tests inject)

    def publish(self) -> None:
        """Clear a reported problem, then enqueue the copy of the device word into host memory.

        Stream-ordered and without a wait, so capturable (pinned memory): the copy of ``ack`` and
        the clear run where the stream is, after every kernel of the forward that could record. On
        CUDA it is one kernel that reads and writes the pinned host words directly; on CPU (the
        interpreter tests) the same steps as tensor ops."""
        if self.device.type == "cuda":
            import triton

            from .status_publish_kernel import publish_kernel

            # one launch: ack in, the clear, the words out (status_publish_kernel.py says why)
            publish_kernel[(1,)](self._words, self._ack, self._host_words, WORDS=WORDS,
                                 PAD=triton.next_power_of_2(WORDS + 2), num_warps=1)
            return
        self._words[ACK:].copy_(self._ack)
        clear_reported(self._words)
        self._host_words.copy_(self._words)

    def code(self) -> int:
        """What the host copy says now (a plain host read)."""
        return int(self.host[0])

    def snapshot(self) -> tuple[int, int, int, int, int]:
        """(code, layer, value, row, seq) of the host copy: plain host reads, no CUDA call (the watchdog
        calls it from its thread, also while a graph is being captured)."""
        return tuple(int(v) for v in self._host_words[:ACK].tolist())  # type: ignore[return-value]

    def claim(self, seq: int) -> bool:
        """True for the first reporter of problem ``seq``; the other one stays silent."""
        with self._lock:
            if seq <= self._claimed:
                return False
            self._claimed = seq
            return True

    def acknowledge(self, seq: int) -> None:
        """Ask the next ``publish`` to clear problem ``seq`` (a host write to pinned memory)."""
        self._ack.fill_(seq)

    def describe(self, code: int, layer: int, value: int, row: int,
                 layer_names: dict[int, str] | None = None) -> tuple[type[Exception], str]:
        """(exception type, message) of a recorded problem: what the raise and the watchdog's log say."""
        where = (layer_names or self.layer_names).get(layer, f"layer {layer}")
        if code == BAD_EXPERT_ID:
            return ValueError, (
                f"[megamoe] {where}: topk_ids holds {value} at token {row}; valid are -1 (masked) and "
                f"0..{self.num_physical - 1}. That entry contributed nothing; no other token was touched."
            )
        if code == NONFINITE_ROW:
            return ValueError, (
                f"[megamoe] {where}: output row {row} is not finite (NaN/Inf in hidden_states row {row}, or "
                "an overflow in its experts); other rows are unaffected."
            )
        if code == NONFINITE_INPUT:
            return ValueError, (
                f"[megamoe] {where}: hidden_states row {row} holds NaN/Inf (found while quantising it); "
                "its output row is not meaningful, other rows are unaffected."
            )
        if code == PEER_TIMEOUT:
            return PeerTimeoutError, (
                f"[megamoe] {where}: ep_rank {self.rank} waited more than MEGA_P2P_TIMEOUT_S={self.timeout_s:g}s for ep_rank "
                f"{value} at the {PHASES.get(row, f'phase {row}')} barrier: that peer died, hangs or runs another step. "
                "This forward's output is not valid; the EP group cannot continue (restart the engine). (Start-up "
                "forwards, which compile kernels, wait up to MEGA_P2P_STARTUP_TIMEOUT_S instead.)"
            )
        if code == ROWS_MISMATCH:
            return TransportError, (
                f"[megamoe] {where}: ep_rank {row} dispatched {value} rows per source, this rank (ep_rank {self.rank}) "
                "expected another number: every rank must pass the same max_tokens_across_ranks to the same forward. "
                "This forward's output is not valid."
            )
        return ValueError, f"[megamoe] {where}: input status word {code} (value {value}, row {row})"

    def raise_if_bad(self, layer_names: dict[int, str] | None = None) -> None:
        """The eager check: raise the recorded problem (and clear it) if the host copy holds one and
        the watchdog has not reported it yet; else return at once.

        A peer timeout under MEGA_ON_PEER_TIMEOUT=exit ends the process (``end_process``) instead."""
        if self.code() == OK:
            return
        if self.device.type == "cuda":
            # Only on the error path: make sure the copy is whole before reading its details.
            torch.cuda.current_stream(self.device).synchronize()
        code, layer, value, row, seq = self.snapshot()
        if code == OK:
            return
        first = self.claim(seq)
        self.acknowledge(seq)
        self.publish()  # clears it on the stream (everything before it has finished: synchronised above)
        self.host.zero_()
        error, message = self.describe(code, layer, value, row, layer_names)
        if code == PEER_TIMEOUT and self.on_peer_timeout == "exit" and first:
            self._end_process(message)
        if first or code == PEER_TIMEOUT:  # a timeout is raised also when the watchdog is ending the process
            raise error(message)

    def _end_process(self, message: str) -> None:
        if self.end_process is not None:
            self.end_process(message)
            return
        end_process(message)


def clear_reported(words: torch.Tensor) -> None:
    """Clear a reported problem from the int64 [6] words (code, layer, value, row, seq, ack), in
    stream order: if seq == ack the host reported this problem, so zero the first four words and
    bump seq (the next problem recorded is a new one); a word already cleared (seq moved on) is left
    alone, and ack is only ever a seq the host saw with a problem, so a clean word is never touched.

    Tensor ops on host memory: the CPU forwards' (interpreter tests, fake status words) form. On CUDA
    ``publish`` runs the same rule inside its one kernel (status_publish_kernel.publish_kernel).
    """
    if int(words[SEQ]) == int(words[ACK]):
        words[:WORDS].zero_()
        words[SEQ] += 1
