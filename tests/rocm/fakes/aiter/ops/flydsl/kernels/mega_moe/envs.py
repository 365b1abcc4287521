"""Fake aiter.ops.flydsl.kernels.mega_moe.envs (ROCm/aiter 4d06fb8d, envs.py).

Every value is read from os.environ when accessed, as upstream's module ``__getattr__`` does
(envs.py:46-50); ``fixed_slot_max_mtpr(default)`` (envs.py:19-20) is what the config reads for the
EP 2 / EP 4 fixed-slot geometries, whose defaults are 512 / 1024 instead of 255.
"""

import os


def _flag(value: str) -> bool:
    return value == "1"


def fixed_slot_max_mtpr(default: int) -> int:
    return int(os.environ.get("AITER_MEGA_FIXED_SLOT_MAX_MTPR", str(default)))


# name -> (parser, default), envs.py:24-41
environment_variables = {
    "AITER_MEGA_FIXED_SLOT_MAX_MTPR": (int, "255"),  # envs.py:28, read once at import by mega_moe_config
    "AITER_MEGA_COMBINE_MASK": (_flag, "0"),  # envs.py:32, default of forward(mask_invalid_slots=)
    "AITER_MEGA_MOE_PRELOAD": (_flag, "0"),
}


def __getattr__(name: str):
    if name in environment_variables:
        parse, default = environment_variables[name]
        return parse(os.environ.get(name, default))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
