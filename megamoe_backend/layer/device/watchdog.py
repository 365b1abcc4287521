"""The watchdog: one host thread per process that reports what the status words hold, graphs or not.

Why: a CUDA-graph replay runs no Python, so the eager check at the start of a forward never sees
a bad expert id, a NaN row or a dead peer recorded during decode; the steps would go on returning
outputs computed without that peer's rows. Every forward (also inside a graph) copies its
workspace's status word into pinned host memory (status.py ``publish``); this thread reads those
copies every ``PERIOD_S``, with plain host reads: no CUDA call, no stream sync, nothing that could
disturb a capture in progress or stall the GPU.

What it does with a problem (each reported once: ``InputStatus.claim`` makes the eager check and
this thread exclusive):
- bad expert id, NaN / Inf row, rows mismatch: one ERROR line naming layer, token and value (the
  same text the eager check raises), at most one line per (layer, problem) every
  ``RATE_LIMIT_S`` (the next line says how many were folded into it); every report is counted
  (``counts``). Then it acknowledges the problem, so the next ``publish`` clears the word in stream
  order and the next problem is recorded.
- a peer timeout: logged (layer, this rank, the peer, the barrier), then the process ends with exit
  status ``process_end.EXIT_STATUS``, as torch's NCCL watchdog ends it with async error handling: the EP group
  cannot continue and every later step would be wrong. With MEGA_ON_PEER_TIMEOUT=raise it is logged
  once and left to the eager check, which raises it as before.
A copy read while the DMA writes it could be torn: a problem is acted on once two polls in a row
saw the same words (the word is sticky, so a real problem stays put).

One thread per process (``process_watchdog``, the documented singleton), started when the first
CUDA workspace creates its status word; a daemon that stops at interpreter exit (atexit) and is
forgotten in a forked child (no thread survives a fork).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from .process_end import end_process
from .status import OK, PEER_TIMEOUT, PROBLEMS, InputStatus

PERIOD_S = 0.05
RATE_LIMIT_S = 10.0

logger = logging.getLogger("megamoe")


@dataclass
class _Watched:
    status: weakref.ref
    previous: tuple | None = None  # what the last poll saw (a problem is acted on when two polls agree)
    logged_timeout: int = -1  # seq of the peer timeout logged under MEGA_ON_PEER_TIMEOUT=raise


@dataclass
class _Limit:
    last_line: float
    folded: int = 0


@dataclass
class Watchdog:
    """Polls the watched status words; ``poll()`` is one round (the thread calls it every ``period_s``)."""

    period_s: float = PERIOD_S
    rate_limit_s: float = RATE_LIMIT_S
    end_process: Callable[[str], None] = end_process
    clock: Callable[[], float] = time.monotonic
    counts: Counter = field(default_factory=Counter)  # (layer name, problem) -> reports
    _watched: list = field(default_factory=list)
    _limits: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def watch(self, status: InputStatus) -> None:
        with self._lock:
            self._watched.append(_Watched(weakref.ref(status)))

    def poll(self) -> None:
        with self._lock:
            self._watched = [w for w in self._watched if w.status() is not None]
            watched = list(self._watched)
        for w in watched:
            status = w.status()
            if status is not None:
                self._check(w, status)

    def _check(self, w: _Watched, status: InputStatus) -> None:
        seen = status.snapshot()
        stable = seen == w.previous
        w.previous = seen
        code, layer, value, row, seq = seen
        if code == OK or not stable:
            return
        _, message = status.describe(code, layer, value, row)
        if code == PEER_TIMEOUT and status.on_peer_timeout == "raise":
            if w.logged_timeout != seq:
                w.logged_timeout = seq
                logger.error(f"{message} (MEGA_ON_PEER_TIMEOUT=raise: the next eager forward raises it)")
            return
        if not status.claim(seq):
            return  # the eager check raised it
        if code == PEER_TIMEOUT:
            self.end_process(message)
            return
        status.acknowledge(seq)
        name = status.layer_names.get(layer, f"layer {layer}")
        self.counts[(name, PROBLEMS.get(code, f"code {code}"))] += 1
        self._log(name, code, message)

    def _log(self, name: str, code: int, message: str) -> None:
        now, key = self.clock(), (name, code)
        limit = self._limits.get(key)
        if limit is not None and now - limit.last_line < self.rate_limit_s:
            limit.folded += 1
            return
        folded = f" (+{limit.folded} more reports of this since the last line)" if limit and limit.folded else ""
        self._limits[key] = _Limit(now)
        logger.error(f"{message}{folded}")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="megamoe-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period_s + 1.0)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - the watchdog must outlive a bad poll; say so, rate-limited
                self._log("watchdog", -1, f"[megamoe] watchdog: a poll failed ({exc!r}); it keeps polling")


_PROCESS_WATCHDOG: Watchdog | None = None  # the documented per-process singleton (module docstring)
_START_LOCK = threading.Lock()


def process_watchdog() -> Watchdog:
    """This process's watchdog, started on first use."""
    global _PROCESS_WATCHDOG
    with _START_LOCK:
        if _PROCESS_WATCHDOG is None:
            _PROCESS_WATCHDOG = Watchdog()
            _PROCESS_WATCHDOG.start()
        return _PROCESS_WATCHDOG


def watch(status: InputStatus) -> None:
    """Have this process's watchdog poll ``status`` (workspaces call it for their CUDA status word)."""
    process_watchdog().watch(status)


def _forget_in_child() -> None:
    global _PROCESS_WATCHDOG, _START_LOCK
    _PROCESS_WATCHDOG, _START_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
