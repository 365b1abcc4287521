"""Fake mori.shmem: the calls MegaMoE makes, with the real signatures (mori/shmem/api.py, 1.2.4)."""

from . import CALL_LOG, REGISTERED_GROUPS

_STATE: dict = {}


def shmem_torch_process_group_init(group_name: str):
    """Real: resolves the group by name through c10d (dist.distributed_c10d._resolve_process_group),
    so the name must have been registered first; returns a status code (0 = success)."""
    CALL_LOG.append(("shmem_torch_process_group_init", group_name))
    if group_name not in REGISTERED_GROUPS:
        raise RuntimeError(f"fake mori: process group {group_name!r} is not registered with c10d")
    _STATE["group_name"] = group_name
    return 0


def shmem_barrier_all():
    CALL_LOG.append(("shmem_barrier_all",))


def shmem_finalize():
    CALL_LOG.append(("shmem_finalize",))
    _STATE.clear()
    return 0


def shmem_mype() -> int:
    return 0


def shmem_npes() -> int:
    return 1
