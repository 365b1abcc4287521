"""Fake of ``aiter`` (ROCm/aiter), for CPU contract tests only.

Restates the public names MegaMoE uses, from ROCm/aiter e4048607 (2026-08-22; MegaMoEV2 and its plan
builder from 4d06fb8d): ActivationType and
QuantType (csrc/include/aiter_enum.h), dtypes, aiter.jit.utils.chip_info.get_gfx,
aiter.ops.shuffle, aiter.ops.flydsl.moe_common.GateMode and the two MegaMoE runtimes.
Every call is appended to CALL_LOG.
"""

import enum

from . import dtypes  # noqa: F401

CALL_LOG: list = []
FAKE_GFX = {"arch": "gfx950"}
# The fake has no GPUs: this is the device index the process runs on (torch.cuda.current_device()),
# where CPU tensors count as living (mega_moe_v2.fake_device_of).
FAKE_GPU = {"current": 0}


class ActivationType(enum.IntEnum):
    No = -1
    Silu = 0
    Gelu = 1
    Swiglu = 2
    Situv2 = 3


class QuantType(enum.IntEnum):
    No = 0
    per_Tensor = 1
    per_Token = 2
    per_1x32 = 3
    per_1x128 = 4
    per_128x128 = 5
    per_256x128 = 6
    per_1024x128 = 7


def reset(arch: str = "gfx950") -> None:
    CALL_LOG.clear()
    FAKE_GFX["arch"] = arch
    FAKE_GPU["current"] = 0
