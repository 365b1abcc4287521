"""Fixtures for the ROCm-path contract tests: fake mori / aiter injected through sys.modules.

Nothing here needs an AMD GPU; the fakes restate the published APIs (docs/rocm.md) and record
every call, so the tests assert exactly what MegaMoE hands to mori and aiter.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

FAKES = Path(__file__).parent / "fakes"
FAKE_ROOTS = ("mori", "aiter", "fake_hip")


def _drop(prefixes, monkeypatch=None):
    for name in list(sys.modules):
        if name.split(".")[0] in prefixes:
            if monkeypatch is not None:
                monkeypatch.delitem(sys.modules, name)
            else:
                del sys.modules[name]


@pytest.fixture
def fakes(monkeypatch):
    """Import the fake mori and aiter under their real names; removed again after the test."""
    _drop(FAKE_ROOTS, monkeypatch)  # a real install (AMD box) is restored by monkeypatch afterwards
    for name in ("MORI_SHMEM_HEAP_SIZE", "MORI_SHMEM_MODE", "AITER_FORCE_A8W4", "AITER_MEGA_FIXED_SLOT_MAX_MTPR",
                 "AITER_MEGA_COMBINE_MASK"):  # read by the fakes, as upstream
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(FAKES))
    importlib.invalidate_caches()
    mori = importlib.import_module("mori")
    aiter = importlib.import_module("aiter")
    for mod in ("aiter.ops.shuffle", "aiter.ops.flydsl.moe_common", "aiter.jit.utils.chip_info",
                "aiter.ops.flydsl.kernels.mega_moe", "aiter.ops.flydsl.kernels.mega_moe_gfx1250",
                "mori.ops.dispatch_combine_v2"):
        importlib.import_module(mod)
    hip = importlib.import_module("fake_hip")
    mori.reset()
    aiter.reset()
    hip.reset()
    from megamoe_backend.experts.aiter import clear_aiter_runtimes
    from megamoe_backend.transport.mori import reset_mori_shmem_state

    reset_mori_shmem_state()
    clear_aiter_runtimes()
    yield SimpleNamespace(mori=mori, aiter=aiter, hip=hip)
    reset_mori_shmem_state()
    clear_aiter_runtimes()
    _drop(FAKE_ROOTS)
