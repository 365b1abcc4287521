"""Fake aiter.ops.flydsl.kernels.mega_moe (ROCm/aiter 4d06fb8d): ``MegaMoEV2`` from mega_moe_v2.py,
its plan builder in mega_moe_config.py, the environment it reads in envs.py."""

from . import envs, mega_moe_config  # noqa: F401
from .mega_moe_v2 import MegaMoEV2, MegaMoEV2LaunchAttrs  # noqa: F401

__all__ = ["MegaMoEV2"]
