"""Fake aiter.jit.utils.chip_info.get_gfx (real: rocminfo / GPU_ARCHS)."""


def get_gfx() -> str:
    from aiter import FAKE_GFX

    return FAKE_GFX["arch"]
