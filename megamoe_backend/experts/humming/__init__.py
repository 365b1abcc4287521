"""The humming experts provider: the experts on humming-kernels' grouped GEMMs (what vLLM runs for MXFP4
experts on Hopper), with the project's A8W4 numerics around them.

- provider.py: HummingExperts, the order of a forward;
- library.py: the one module that imports ``humming`` (weights transform, kernel compile and launch);
- weights.py: a layer's experts in humming's layout, in place of the row-major copy;
- kernels.py: the Triton kernels for the steps humming's epilogue cannot do (SwiGLU + A2, the wire rows).

Who runs the GEMMs, Triton or humming, is decided in experts/gemm_choice.py. Importing this package never
imports humming (nor Triton): ``HummingExperts`` is loaded on first access.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "HummingExperts":
        from .provider import HummingExperts

        return HummingExperts
    raise AttributeError(name)


__all__ = ["HummingExperts"]
