"""How much of mori's symmetric heap aiter's MegaMoEV2 takes, and whether MORI_SHMEM_HEAP_SIZE holds it.

Why: MegaMoEV2 allocates its dispatch / combine buffers with ``mori_shmem_create_tensor``, out of
one process-wide heap fixed when mori shmem initialises. An exhausted heap surfaces part-way
through the first forward as ``AssertionError: mori_shmem.shmem_malloc failed``; checking the size
at start-up turns that into an error naming the variable and the size to set. The runtimes are the
ones aiter's plan gives (``Selection.runtimes``: a fixed-slot decode runtime and the max one, as
vLLM 0.34 builds them), all alive at once and shared by every layer (runtime.py), so the need is
their sum; whether a runtime is fixed-slot is aiter's answer (its plan builder, which reads
AITER_MEGA_FIXED_SLOT_MAX_MTPR), never a threshold restated here.

Without MORI_SHMEM_HEAP_SIZE the check assumes 2 GiB: the default vLLM 0.34 states for the mori it
runs ("the MoRI symmetric heap, which defaults to 2 GB", all2all.py:951-955, where it sets 8G / 16G
itself for aiter_mega_moe, 962-966) and the static default of earlier mori releases; ROCm/mori
624002c8 raised it to 4 GiB (include/mori/shmem/internal.hpp:61). The compiled default of an
installed mori cannot be read from Python, so the smaller one is assumed and the message says what
to set (``megamoe info --device rocm`` prints the same figure).

Sizes restate ROCm/aiter e4048607 (the last revision whose intranode op this project read; 4d06fb8d
builds it with the same config), all allocations of one MegaMoEV2:
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

HEAP_SIZE_ENV = "MORI_SHMEM_HEAP_SIZE"
HEAP_MODE_ENV = "MORI_SHMEM_MODE"
GIB = 1 << 30
ASSUMED_DEFAULT_HEAP = 2 * GIB  # vLLM 0.34 all2all.py:951-955 (mori 624002c8: 4 GiB, internal.hpp:61)
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


def v2_shmem_bytes(world: int, hidden: int, experts_per_rank: int, topk: int, mtpr: int, fixed_slot: bool) -> int:
    """Symmetric-heap bytes one MegaMoEV2 allocates (its intermediate-size buffers are ordinary device
    memory). ``fixed_slot``: aiter's plan for this runtime (``fixed_slot_dispatch``)."""
    w, h, k, epr, mt = world, hidden, topk, experts_per_rank, mtpr
    scale_bytes = h // 32  # fp8 dispatch: one E8M0 per 32
    # intranode op: dispatch receive side sized by world_size (max_total_recv_tokens = world_size)
    combine_in = max(w * mt, mt * k) * 2 * h
    intranode = [w * h, 4 * w * k, 4 * w * k, w * scale_bytes, 4, 4 * w, 4 * w,
                 combine_in, 4 * w * mt * k, 2 * mt * h, 4 * mt * k, 8 * w]
    compact = not fixed_slot
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


def cco_per_rank_vmm(world_size: int, hidden: int, mtpr: int) -> int:
    """Symmetric VMM per rank: worst case every rank sends all its bf16 tokens to one peer, twice
    (tokens and combine staging), plus slack -- the sizing ATOM uses for the same arena."""
    window = world_size * mtpr * hidden * 2 * 2 + (1 << 24)
    return 2 * window + (1 << 28)


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
            return cls(ASSUMED_DEFAULT_HEAP, f"{HEAP_SIZE_ENV} unset (assumed 2 GiB, the default vLLM 0.34 states for mori)")
        return cls(parse_mori_size(raw), f"{HEAP_SIZE_ENV}={raw}")

    def check(self, needed: int, what: str) -> None:
        """``needed`` bytes of allocations must fit next to what mori itself keeps on the heap."""
        if self.capacity is None or needed + MORI_HEAP_RESERVED <= self.capacity:
            return
        needed += MORI_HEAP_RESERVED
        unit, suffix = (GIB, "G") if needed >= GIB else (1 << 20, "M")
        raise KnobError(
            f"{self.source} is smaller than the {needed / unit:.2f} {suffix}iB of mori symmetric heap that {what} "
            f"needs; set {HEAP_SIZE_ENV}={heap_to_set(needed - MORI_HEAP_RESERVED)} (or more) in the environment before "
            "the engine starts (mori reads it when its shmem initialises)"
        )


def heap_to_set(needed: int) -> str:
    """The MORI_SHMEM_HEAP_SIZE value that holds ``needed`` bytes of allocations (whole GiB, or MiB below 1 GiB)."""
    total = needed + MORI_HEAP_RESERVED
    unit, suffix = (GIB, "G") if total >= GIB else (1 << 20, "M")
    return f"{-(-total // unit)}{suffix}"


def heap_report(plan, env: Mapping[str, str] | None = None) -> dict | None:
    """What ``megamoe info`` prints for a fused plan: the symmetric memory its shared runtimes take and
    what to set. MegaMoEV2: mori's heap (MORI_SHMEM_HEAP_SIZE), the sum over ``Selection.runtimes``;
    MegaMoEGfx1250: the cco arena each rank maps (its ``per_rank_vmm``). None for an unfused plan."""
    sel = plan.backends
    if sel.runtime == "MegaMoEV2":
        epr = plan.placement.num_physical // plan.ep_size
        need = sum(v2_shmem_bytes(plan.ep_size, plan.hidden, epr, plan.topk, r.capacity, r.fixed_slot)
                   for r in sel.runtimes)
        heap = MoriHeap.from_env(env)
        fits = heap.capacity is None or need + MORI_HEAP_RESERVED <= heap.capacity
        return dict(kind="mori symmetric heap", runtimes=[r.describe() for r in sel.runtimes], bytes=need,
                    set=f"{HEAP_SIZE_ENV}={heap_to_set(need)}", now=heap.source, fits=fits)
    if sel.runtime == "MegaMoEGfx1250":
        vmm = cco_per_rank_vmm(plan.ep_size, plan.hidden, sel.mtpr)
        return dict(kind="mori cco arena per rank (Communicator per_rank_vmm)", runtimes=[f"{sel.mtpr}"], bytes=vmm,
                    set="(sized by MegaMoE, nothing to set)", now="", fits=True)
    return None


def describe_heap(report: dict) -> str:
    """One line of ``heap_report`` for the startup log and ``megamoe info``."""
    verdict = "" if report["fits"] else " -- too small: the start-up check refuses it"
    now = f" (now: {report['now']}{verdict})" if report["now"] else ""
    return (f"{report['kind']}: {report['bytes'] / GIB:.2f} GiB for {' + '.join(report['runtimes'])}; "
            f"set {report['set']}{now}")
