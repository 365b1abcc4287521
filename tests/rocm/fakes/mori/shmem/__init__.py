"""Fake mori.shmem: ``from .api import *`` plus the lazy tensor helper, as the real package does
(python/mori/shmem/__init__.py, ROCm/mori 624002c8)."""

from . import api  # noqa: F401  (the real package exposes its api submodule the same way)
from .api import *  # noqa: F401,F403
from .tensor_utils import mori_shmem_create_tensor  # noqa: F401
