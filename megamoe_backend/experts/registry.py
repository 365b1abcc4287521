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


def make_provider(name: str) -> ExpertsProvider:
    try:
        target = PROVIDERS[name]
    except KeyError:
        raise ValueError(f"unknown experts provider {name!r}; available: {', '.join(PROVIDERS)}") from None
    module_name, cls_name = target.split(":")
    return getattr(importlib.import_module(module_name), cls_name)()
