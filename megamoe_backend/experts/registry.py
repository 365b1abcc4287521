"""Experts providers by name, imported lazily so CPU installs never import GPU stacks."""

from __future__ import annotations

import importlib

from ..knobs import Knobs
from .base import ExpertsProvider

# name -> "module:Class"; hardware providers live in their own modules. aiter is not here: its
# MegaMoE runtimes are fused (they own dispatch and combine too), so the layer drives them directly.
PROVIDERS = {
    "torch": "megamoe_backend.experts.reference:TorchReferenceExperts",
    "triton": "megamoe_backend.experts.triton:TritonExperts",
}


def make_provider(name: str, capacity: int | None = None, knobs: Knobs | None = None) -> ExpertsProvider:
    """``capacity``: most (row, expert) pairs a forward may carry (MTPR x top-k x ep_size); the
    Triton provider sizes its static, CUDA-graph-capturable layout by it and refuses more.
    ``knobs``: the operator's choices (the layer passes its plan's): the Triton provider takes
    MEGA_EXPERTS_GEMM from them, so the environment is read once, by Knobs.from_env; None: the defaults."""
    try:
        target = PROVIDERS[name]
    except KeyError:
        raise ValueError(f"unknown experts provider {name!r}; available: {', '.join(PROVIDERS)}") from None
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if name != "triton":
        return cls()
    return cls(capacity=capacity, gemm=(knobs or Knobs()).experts_gemm)


def describe_experts_gemm(choice: str, provider: str) -> str:
    """What ``megamoe info`` says runs the frag8 expert GEMMs for MEGA_EXPERTS_GEMM=``choice``."""
    if provider != "triton":
        return f"{provider} provider (MEGA_EXPERTS_GEMM applies to the triton provider's frag8 GEMMs)"
    return f"Triton (MEGA_EXPERTS_GEMM={choice}; the sm_90a CUDA GEMMs are research code: benchmarks/research/cuda_gemms)"
