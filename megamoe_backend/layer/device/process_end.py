"""Ending the process on a peer timeout (MEGA_ON_PEER_TIMEOUT=exit): the one place that does it.

Why its own module: both reporters of a peer timeout end the process the same way, the watchdog
thread (watchdog.py, under graph replays) and the eager check (status.py ``raise_if_bad``); the
watchdog imports the status word, so the status word cannot import the watchdog for this.
"""

from __future__ import annotations

import logging
import os
import sys

EXIT_STATUS = 70  # EX_SOFTWARE: what a process ended on a peer timeout returns (as torch's NCCL watchdog)

logger = logging.getLogger("megamoe")


def end_process(message: str) -> None:
    """Log a peer timeout and end this process at once (no Python cleanup: the EP group is broken, and
    a clean shutdown could wait on the dead peer). Flushes the log first."""
    logger.error(f"{message} Ending this process (exit status {EXIT_STATUS}, MEGA_ON_PEER_TIMEOUT=exit; "
                 "MEGA_ON_PEER_TIMEOUT=raise raises at the next eager forward instead).")
    for handler in logger.handlers + logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - nothing may keep the process alive now
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(EXIT_STATUS)
