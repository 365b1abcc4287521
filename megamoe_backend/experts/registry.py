"""Experts providers by name, imported lazily so CPU installs never import GPU stacks."""

from __future__ import annotations

import importlib

from .base import ExpertsProvider

# name -> "module:Class"; hardware providers live in their own modules. aiter is not here: its
# MegaMoE runtimes are fused (they own dispatch and combine too), so the layer drives them directly.
PROVIDERS = {
    "torch": "megamoe_backend.experts.reference:TorchReferenceExperts",
    "triton": "megamoe_backend.experts.triton:TritonExperts",
}


def make_provider(name: str, capacity: int | None = None) -> ExpertsProvider:
    """``capacity``: most (row, expert) pairs a forward may carry (MTPR x top-k x ep_size); the
    Triton provider sizes its static, CUDA-graph-capturable layout by it and refuses more."""
    try:
        target = PROVIDERS[name]
    except KeyError:
        raise ValueError(f"unknown experts provider {name!r}; available: {', '.join(PROVIDERS)}") from None
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(capacity=capacity) if name == "triton" else cls()
