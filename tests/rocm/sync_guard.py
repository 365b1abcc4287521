"""A CPU stand-in for CUDA's sync-debug mode: the host reads of device data that stall a GPU stream
(and break graph capture) raise when megamoe_backend itself makes them.

Why a guard and not ``torch.cuda.set_sync_debug_mode``: there is no GPU here. On a GPU every one of
these reads device memory from the host -- ``Tensor.__bool__`` / ``item`` / ``tolist`` / ``int()`` /
``float()``, ``nonzero`` (its result size is data-dependent), ``.cpu()``, and indexing with a 0-d
integer tensor (``t[i]``: torch reads ``i`` on the host; found on an H200 under
``set_sync_debug_mode("error")``, which the first version of this guard missed) -- so a forward that calls
none of them from megamoe_backend's own code has no host synchronisation of its own. Calls from
torch, Triton's interpreter or the fakes (which stand in for mori / aiter kernels) are allowed:
only the immediate caller's file is judged. A read on a source line that first tests
``device.type == "cpu"`` (a validation that only runs for CPU tensors, e.g. the Triton provider's
pairs.row range check) syncs nothing on a GPU and is allowed, and so is ``CPU_ONLY``: functions
whose host reads are their CPU branch (on a GPU the same work is a kernel).
"""

from __future__ import annotations

import contextlib
import linecache
import sys
import threading
from pathlib import Path

import torch

PACKAGE = str(Path(__file__).resolve().parents[2] / "megamoe_backend")
# (file under megamoe_backend/, function): the status word's clear runs as one Triton program on CUDA,
# as tensor ops on host memory on CPU (clear_reported); code / snapshot read the status word's pinned
# host copy, which the device fills without the host waiting (status.py's design)
CPU_ONLY = {("layer/device/status.py", "clear_reported"), ("layer/device/status.py", "code"),
            ("layer/device/status.py", "snapshot")}
_METHODS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero", "cpu")


class HostSyncError(AssertionError):
    pass


def _wrap(name, original):
    def guarded(self, *args, **kwargs):
        frame = sys._getframe(1)
        caller = frame.f_code.co_filename
        where = (caller[len(PACKAGE) + 1:], frame.f_code.co_name)
        cpu_only = where in CPU_ONLY or 'device.type == "cpu"' in linecache.getline(caller, frame.f_lineno)
        if caller.startswith(PACKAGE) and not cpu_only:
            raise HostSyncError(f"host read of device data: Tensor.{name} called from {caller}:{frame.f_lineno}")
        return original(self, *args, **kwargs)

    return guarded


_STATE = {"depth": 0, "originals": None}
_LOCK = threading.Lock()


def _scalar_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dim() == 0 and not p.is_floating_point() and p.dtype != torch.bool
               for p in parts)


def _wrap_getitem(original):
    def guarded(self, index):
        frame = sys._getframe(1)
        if frame.f_code.co_filename.startswith(PACKAGE) and _scalar_index(index):
            raise HostSyncError(f"host read of device data: indexing with a 0-d tensor at {frame.f_code.co_filename}:"
                                f"{frame.f_lineno}")
        return original(self, index)

    return guarded


@contextlib.contextmanager
def no_host_sync():
    """Re-entrant and shared by threads (the rank threads of one test): patched on the first entry,
    restored on the last exit."""
    with _LOCK:
        if _STATE["depth"] == 0:
            originals = {name: getattr(torch.Tensor, name) for name in _METHODS}
            originals["torch.nonzero"] = torch.nonzero
            originals["__getitem__"] = torch.Tensor.__getitem__
            _STATE["originals"] = originals
            for name in _METHODS:
                setattr(torch.Tensor, name, _wrap(name, originals[name]))
            torch.Tensor.__getitem__ = _wrap_getitem(originals["__getitem__"])
            nonzero = originals["torch.nonzero"]
            torch.nonzero = _wrap("torch.nonzero", lambda t, *a, **k: nonzero(t, *a, **k))
        _STATE["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["depth"] -= 1
            if _STATE["depth"] == 0:
                originals = _STATE["originals"]
                for name in _METHODS:
                    setattr(torch.Tensor, name, originals[name])
                torch.Tensor.__getitem__ = originals["__getitem__"]
                torch.nonzero = originals["torch.nonzero"]
