"""How much of mori's symmetric heap aiter's MegaMoEV2 takes, and whether MORI_SHMEM_HEAP_SIZE holds it.

Why: MegaMoEV2 allocates its dispatch / combine buffers with ``mori_shmem_create_tensor``, out of
one process-wide heap fixed when mori shmem initialises (4 GiB unless MORI_SHMEM_HEAP_SIZE says
otherwise). An exhausted heap surfaces part-way through the first forward as ``AssertionError:
mori_shmem.shmem_malloc failed``; checking the size at start-up turns that into an error naming the
variable and the size to set. DeepSeek shapes at EP 8 need about 0.24 GiB at MTPR 128, 0.6 at
1024 and 2.3 at 4096 per runtime -- one runtime, shared by every layer (runtime.py).

Sizes restate ROCm/aiter e4048607, all allocations of one MegaMoEV2:
- kernels/flydsl_dispatch_combine_intranode_op.py ``_alloc_buffers`` (657-697) with the config
  MegaMoEV2 builds (mega_moe_v2.py:57-62: fp8 dispatch, bf16 combine, ``max_total_recv_tokens =
  world_size``, so the dispatch-side receive count is ``world_size``);
- ``FlyDSLDispatchGroupMajorOp._alloc`` (435-505), sized by ``num_valid_max`` (414-421);
- ``MegaMoEV2._allocate_dispatch_workspace`` (mega_moe_v2.py:129-136).
and ROCm/mori 624002c8: every ``ShmemMalloc`` is 256-byte aligned (src/shmem/memory.cpp:37), the
heap starts 256 bytes in (init.cpp:260) and holds a 1 KiB internal sync block (init.cpp:505).
Not run on AMD hardware: the fakes in tests/rocm account the same allocations one by one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

from ...knobs import KnobError
from ...platform.rocm_rules import V2_FIXED_SLOT_MAX_MTPR

HEAP_SIZE_ENV = "MORI_SHMEM_HEAP_SIZE"
HEAP_MODE_ENV = "MORI_SHMEM_MODE"
GIB = 1 << 30
MORI_DEFAULT_STATIC_HEAP = 4 * GIB  # include/mori/shmem/internal.hpp:61
MORI_ALIGNMENT = 256  # src/shmem/memory.cpp:37
MORI_HEAP_RESERVED = 256 + 1024  # initial offset (init.cpp:260) + internal sync block (init.cpp:505)
SORT_BLOCK_M = 32  # MegaMoEV2._build_fused_stage1: metadata blocks per 32 rows (mega_moe_v2.py:75,82)

# ParseSizeString (src/shmem/init.cpp:96-150): digits, then exactly one of these suffixes (any other
# tail is silently dropped by std::stoull, e.g. "8gB" -> 8 bytes, so we refuse it).
_SIZE_SUFFIX = {"": 1}
for _unit, _bytes in (("K", 1 << 10), ("M", 1 << 20), ("G", GIB)):
    for _suffix in (f"{_unit}iB", f"{_unit.lower()}ib", f"{_unit}B", f"{_unit.lower()}b", f"{_unit}b", _unit, _unit.lower()):
        _SIZE_SUFFIX[_suffix] = _bytes
_SIZE_RE = re.compile(r"^(\d+)([A-Za-z]*)$")


def _align(n: int) -> int:
    return -(-n // MORI_ALIGNMENT) * MORI_ALIGNMENT


def v2_shmem_bytes(world: int, hidden: int, experts_per_rank: int, topk: int, mtpr: int) -> int:
    """Symmetric-heap bytes one MegaMoEV2 allocates (its intermediate-size buffers are ordinary device memory)."""
    w, h, k, epr, mt = world, hidden, topk, experts_per_rank, mtpr
    scale_bytes = h // 32  # fp8 dispatch: one E8M0 per 32
    # intranode op: dispatch receive side sized by world_size (max_total_recv_tokens = world_size)
    combine_in = max(w * mt, mt * k) * 2 * h
    intranode = [w * h, 4 * w * k, 4 * w * k, w * scale_bytes, 4, 4 * w, 4 * w,
                 combine_in, 4 * w * mt * k, 2 * mt * h, 4 * mt * k, 8 * w]
    compact = mt > V2_FIXED_SLOT_MAX_MTPR
    unit = 128 if compact else 32
    # num_valid_max: rows of the expert-major receive buffer (intranode op 414-421)
    nvm = w * mt * k + epr * unit if compact else epr * (-(-w * mt // unit) * unit) + 256
    group_major = [4 * w, 4 * epr, 4 * epr, nvm * h, 4 * max(1, nvm * -(-scale_bytes // 4)), 4 * nvm, 4 * nvm,
                   4 * nvm, 4 * w]
    if compact:
        group_major += [4 * epr, 4 * w, 4 * epr, 4 * w, 4 * w * w * epr, 4 * w]
    metadata_blocks = -(-nvm // SORT_BLOCK_M)
    workspace = [4 * w * epr, 8 * w, 4 * w * epr, 8 * w, 8 * epr, 4 * w, 4 * metadata_blocks, 4]
    return sum(_align(n) for n in intranode + group_major + workspace)


def parse_mori_size(raw: str) -> int:
    """MORI_SHMEM_HEAP_SIZE as mori reads it; a value mori would read differently is an error here."""
    m = _SIZE_RE.match(raw)
    if not m or m.group(2) not in _SIZE_SUFFIX:
        raise KnobError(
            f"{HEAP_SIZE_ENV}={raw!r}: mori reads an integer byte count with an optional K/M/G (KB, KiB, ...) "
            "suffix and no spaces (src/shmem/init.cpp ParseSizeString reads '6.5G' as 6G and '8gB' as 8 bytes); e.g. 8G"
        )
    return int(m.group(1)) * _SIZE_SUFFIX[m.group(2)]


@dataclass(frozen=True)
class MoriHeap:
    """The symmetric heap mori will create (or created), from its environment."""

    capacity: int | None  # bytes; None: isolation mode, every allocation has its own object
    source: str  # for messages: the variable and value it came from

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "MoriHeap":
        """init.cpp ConfigureShmemMode (615-637) and the heap size read (223-227, 289-299).

        vmm_heap falls back to a static heap when VMM is unsupported (init.cpp:360-371), whose
        default is 4 GiB: without MORI_SHMEM_HEAP_SIZE that smaller default is what we check.
        """
        env = os.environ if env is None else env
        mode = (env.get(HEAP_MODE_ENV) or "").strip()
        if mode.lower() == "isolation":
            return cls(None, f"{HEAP_MODE_ENV}={mode}")
        raw = env.get(HEAP_SIZE_ENV)
        if raw is None:
            return cls(MORI_DEFAULT_STATIC_HEAP, f"{HEAP_SIZE_ENV} unset (mori's default 4 GiB)")
        return cls(parse_mori_size(raw), f"{HEAP_SIZE_ENV}={raw}")

    def check(self, needed: int, what: str) -> None:
        """``needed`` bytes of allocations must fit next to what mori itself keeps on the heap."""
        if self.capacity is None or needed + MORI_HEAP_RESERVED <= self.capacity:
            return
        needed += MORI_HEAP_RESERVED
        unit, suffix = (GIB, "G") if needed >= GIB else (1 << 20, "M")
        raise KnobError(
            f"{self.source} is smaller than the {needed / unit:.2f} {suffix}iB of mori symmetric heap that {what} "
            f"needs; set {HEAP_SIZE_ENV}={-(-needed // unit)}{suffix} (or more) in the environment before the engine "
            "starts (mori reads it when its shmem initialises)"
        )
