"""Fake of the ``mori`` package (amd-mori 1.2.4), for CPU contract tests only.

Shaped after the wheel's Python files (amd_mori-1.2.4-cp312-cp312-manylinux_2_39_x86_64.whl,
sha256 52dd1ee8...) and ROCm/mori 624002c8: ``mori.shmem`` (api.py, tensor_utils.py), ``mori.ops``
(dispatch_combine.py) and ``mori.cco`` (communicator.py). Every call is appended to ``CALL_LOG`` so tests can assert order and arguments.
The dispatch/combine fakes also move data between in-process ranks (threads), so a transport built
on them can be checked numerically; they do not model mori's kernels, slot order or timing.
"""

__version__ = "1.2.4"

CALL_LOG: list = []
REGISTERED_GROUPS: dict = {}


def reset() -> None:
    CALL_LOG.clear()
    REGISTERED_GROUPS.clear()
    shmem.api._reset()
    ops._FABRICS.clear()
    cco._STATE.clear()


def fake_register_process_group(name, group) -> None:
    """Stands in for torch._C._distributed_c10d._register_process_group in tests."""
    CALL_LOG.append(("_register_process_group", name, group))
    REGISTERED_GROUPS[name] = group


from . import cco, ops, shmem  # noqa: E402  (submodules are package attributes, like mori's lazy ones)

__all__ = ["CALL_LOG", "REGISTERED_GROUPS", "cco", "fake_register_process_group", "ops", "reset", "shmem"]
