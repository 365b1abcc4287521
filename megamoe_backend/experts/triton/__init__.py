"""Triton expert kernels (portable Triton; tuned for NVIDIA H200).

Pipeline per forward: expert-sorted layout (layout.py, sync-free) -> GEMM1 + SwiGLU + A2 re-quant
(gemm1.py) -> GEMM2 x route weight, scattered back to pair order (gemm2.py). MX quantisation
kernels live in quant.py. Importing this package never fails without Triton: check
``triton_available()`` before touching the kernel modules.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is optional for the CPU install)."""
    return importlib.util.find_spec("triton") is not None


def __getattr__(name: str):
    # Lazy: ``from megamoe_backend.experts.triton import TritonExperts`` imports Triton only then.
    if name in ("TritonExperts", "select_experts_provider"):
        from . import provider

        return getattr(provider, name)
    raise AttributeError(name)


__all__ = ["TritonExperts", "select_experts_provider", "triton_available"]
