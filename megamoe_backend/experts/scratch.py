"""The experts' intermediate buffers, sized once and shared by the layers of one shape.

Why: a forward of the Triton experts writes a dozen intermediates (the A operand re-scaled per
received row, the expert layout, GEMM1's A2 and its row scales). Allocated per call they cost
allocator work in every layer of every step, and under CUDA-graph capture each one is memory of the
graph's pool. The device workspaces (layer/device/workspace.py) own one ``ExpertsScratch`` each, so
the 61 layers of one shape reuse one set: a layer's forward finishes on the stream before the next
layer's starts, and nothing here outlives a forward.

``take`` hands out a view of a named buffer; the provider asks with ``reserve`` = the size at its
capacity (MEGA_MAX_TOKENS_PER_RANK x top-k x ep_size pairs), so the first forward allocates every
buffer at its largest and no later one allocates. A request beyond a buffer (a provider without a
capacity, a custom tile config taller than the reserve assumed) replaces it with a larger one and
keeps the old one alive in ``_outgrown``: a CUDA graph captured earlier still addresses it, and its
replays must not land in memory handed to anyone else.
"""

from __future__ import annotations

import math

import torch


class ExpertsScratch:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}  # name -> uint8 buffer
        self._outgrown: list[torch.Tensor] = []  # replaced buffers a captured graph may still address
        self.allocations = 0  # how many buffers were allocated (tests: a second forward adds none)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, reserve: int = 0) -> torch.Tensor:
        """A ``dtype`` tensor of ``shape`` over buffer ``name`` (contents undefined); the buffer holds at
        least ``reserve`` elements of ``dtype`` (the size at capacity), allocated once."""
        numel = math.prod(shape)
        buf = self._buffer(name, numel * dtype.itemsize, max(numel, reserve) * dtype.itemsize, torch.empty)
        return buf[: numel * dtype.itemsize].view(dtype).view(shape)

    def counters(self, name: str, count: int) -> torch.Tensor:
        """``count`` int32 counters that keep their values between forwards: zero when allocated, and
        the kernels that use them leave them zero (the persistent GEMMs' item claims, mainloop.py)."""
        return self._buffer(name, count * 4, count * 4, torch.zeros)[: count * 4].view(torch.int32)

    def _buffer(self, name: str, nbytes: int, reserve_bytes: int, make) -> torch.Tensor:
        """Buffer ``name`` of at least ``nbytes``; a new one (``make``: torch.empty / torch.zeros) holds
        ``reserve_bytes`` rounded up to 16, and one it replaces stays alive (a graph may address it)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                self._outgrown.append(buf)
            buf = make(-(-reserve_bytes // 16) * 16, dtype=torch.uint8, device=self.device)
            self._buffers[name] = buf
            self.allocations += 1
        return buf

    def bytes_named(self, prefix: str) -> int:
        """Bytes of the live buffers whose names start with ``prefix`` (one provider's share: "humming.")."""
        return sum(b.numel() for name, b in self._buffers.items() if name.startswith(prefix))

    @property
    def bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values()) + sum(b.numel() for b in self._outgrown)


def scratch_counters(scratch: ExpertsScratch | None, name: str, count: int, device: torch.device) -> torch.Tensor:
    """``scratch.counters`` where the caller passed a scratch, else fresh zeroed counters."""
    if scratch is None:
        return torch.zeros(count, dtype=torch.int32, device=device)
    return scratch.counters(name, count)


def scratch_empty(scratch: ExpertsScratch | None, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device, reserve: int = 0) -> torch.Tensor:
    """``scratch.take`` where the caller passed a scratch (the layer's forwards), else a fresh tensor
    (direct use: benchmarks and tests of the experts alone)."""
    if scratch is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return scratch.take(name, shape, dtype, reserve)
