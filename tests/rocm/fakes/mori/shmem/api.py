"""Fake mori.shmem.api with the state mori's C++ keeps: whether shmem runs, on which world, its heap.

Signatures from python/mori/shmem/api.py (ROCm/mori 624002c8; amd-mori 1.2.x has the same).
Constraints copied, each failing where mori fails:
- shmem is process-wide; a second init is skipped silently and keeps the first world
  (src/shmem/init.cpp:669-674);
- ``shmem_torch_process_group_init`` broadcasts the unique id from *global* rank 0 (api.py:113-119):
  torch refuses that for a group without global rank 0 (the fake dist raises the same ValueError);
- ``shmem_mype`` / ``shmem_npes`` before init read a null pointer (src/shmem/runtime.cpp:172-180):
  a crash in mori, a RuntimeError here;
- the symmetric heap: MORI_SHMEM_HEAP_SIZE parsed at init like ParseSizeString (init.cpp:96-150,
  223-227; default 4 GiB, include/mori/shmem/internal.hpp:61; MORI_SHMEM_MODE=isolation has no
  heap, init.cpp:349-352); 256 bytes reserved up front (init.cpp:260) and a 1 KiB sync block
  (init.cpp:505); every allocation 256-byte aligned (src/shmem/memory.cpp:37); an allocation past
  the end returns 0 (memory.cpp:43-48). Bytes are only counted: no memory is allocated.
``DIST`` stands in for torch.distributed (tests set it); ``_shmem_module_loaded_gpus`` is the
real module's record of the GPUs an init ran on (api.py:34, 79, 175).
"""

import os

from .. import CALL_LOG, REGISTERED_GROUPS

MORI_SHMEM_INIT_WITH_MPI_COMM = 0
MORI_SHMEM_INIT_WITH_UNIQUEID = 1
UNIQUE_ID_BYTES = 128  # MORI_SHMEM_UNIQUE_ID_BYTES (pybind_shmem.cpp:62-64 checks it)
DEFAULT_STATIC_HEAP = 4 << 30
ALIGNMENT = 256
_GPU = 0  # the fake's current HIP device

DIST = None  # tests: an object with get_rank / get_world_size / broadcast_object_list
_STATE: dict = {}
_shmem_module_loaded_gpus: set = set()


def _parse_size(text: str) -> int:
    """ParseSizeString: 3-, 2-, then 1-character suffix, then std::stoull on what is left."""
    units = {"G": 1 << 30, "M": 1 << 20, "K": 1 << 10}
    num, mult = text, 1
    for suffixes in ({u + "iB": m for u, m in units.items()} | {u.lower() + "ib": m for u, m in units.items()},
                     {s: m for u, m in units.items() for s in (u + "B", u.lower() + "b", u + "b")},
                     {s: m for u, m in units.items() for s in (u, u.lower())}):
        for suffix, m in suffixes.items():
            if mult == 1 and num.endswith(suffix):
                num, mult = num[: -len(suffix)], m
    digits = num.lstrip()
    end = len(digits) - len(digits.lstrip("0123456789"))
    if end == 0:
        raise ValueError(f"std::stoull: invalid argument {text!r}")  # std::invalid_argument
    return int(digits[:end]) * mult


def _reset() -> None:
    global DIST
    DIST = None
    _STATE.clear()
    _shmem_module_loaded_gpus.clear()


def shmem_get_unique_id() -> bytes:
    CALL_LOG.append(("shmem_get_unique_id",))
    return b"U" * UNIQUE_ID_BYTES


def shmem_init_attr(flags: int, rank: int, nranks: int, unique_id: bytes):
    CALL_LOG.append(("shmem_init_attr", flags, rank, nranks))
    if flags != MORI_SHMEM_INIT_WITH_UNIQUEID or not isinstance(unique_id, bytes) or len(unique_id) != UNIQUE_ID_BYTES:
        raise RuntimeError("Invalid unique ID size")
    _shmem_module_loaded_gpus.add(_GPU)
    if _STATE.get("npes"):
        return 0  # "Shmem already initialized, skipping"
    mode = os.environ.get("MORI_SHMEM_MODE", "")
    raw = os.environ.get("MORI_SHMEM_HEAP_SIZE")
    heap = None if mode in ("isolation", "ISOLATION") else (_parse_size(raw) if raw else DEFAULT_STATIC_HEAP)
    _STATE.update(mype=rank, npes=nranks, heap=heap, used=256)
    _STATE["sync"] = shmem_malloc(1024)
    return 0


def shmem_torch_process_group_init(group_name: str):
    CALL_LOG.append(("shmem_torch_process_group_init", group_name))
    if DIST is None:
        raise RuntimeError("torch.distributed not initialized.")
    if group_name not in REGISTERED_GROUPS:
        raise RuntimeError(f"fake mori: process group {group_name!r} is not registered with c10d")
    group = REGISTERED_GROUPS[group_name]
    rank, world = DIST.get_rank(group), DIST.get_world_size(group)
    box = [shmem_get_unique_id() if rank == 0 else None]
    DIST.broadcast_object_list(box, src=0, group=group)
    return shmem_init_attr(MORI_SHMEM_INIT_WITH_UNIQUEID, rank, world, box[0])


def shmem_finalize():
    CALL_LOG.append(("shmem_finalize",))
    _reset()
    return 0


def _require_init(what: str) -> None:
    if not _STATE.get("npes"):
        raise RuntimeError(f"fake mori: {what} before shmem init reads a null bootStates (runtime.cpp:172-180)")


def shmem_mype() -> int:
    _require_init("shmem_mype")
    return _STATE["mype"]


def shmem_npes() -> int:
    _require_init("shmem_npes")
    return _STATE["npes"]


def shmem_barrier_all():
    _require_init("shmem_barrier_all")
    CALL_LOG.append(("shmem_barrier_all",))


def shmem_malloc(size: int) -> int:
    """A fake address, or 0 when the heap is full (the real one logs "Out of static heap memory")."""
    _require_init("shmem_malloc")
    if _STATE["heap"] is None:
        return 1 << 40  # isolation mode: every allocation is its own object
    start = -(-_STATE["used"] // ALIGNMENT) * ALIGNMENT
    if start + size > _STATE["heap"]:
        CALL_LOG.append(("shmem_malloc failed", size))
        return 0
    _STATE["used"] = start + size
    return (1 << 40) + start


def heap_used() -> int:
    """Fake-only: bytes of the heap taken so far."""
    return _STATE.get("used", 0)
