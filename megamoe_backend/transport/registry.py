"""Transports of the torch forward by name, imported lazily (mori needs ROCm). MEGA_DISPATCH=symm | ipc
are the device P2P forward (layer/device/p2p.py over transport/peer_arena.py), not transports here: the
forward oracle (plan/forward_choice.py) refuses the torch forward over them before this is asked.

``plan`` is a LayerPlan, read by its fields only: the transports sit below the plan and do not import it."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .base import Transport
from .torch_dist import LocalTransport, TorchDistTransport

TRANSPORTS = {
    "mori": "megamoe_backend.transport.mori:MoriTransport",
}


def make_transport(plan: Any, group: Any, device: torch.device) -> Transport:
    name = plan.backends.transport
    if group is None:
        if plan.ep_size != 1:
            raise ValueError(f"ep_size={plan.ep_size} needs a process group (group=None given)")
        return LocalTransport()
    if name in ("gloo", "nccl"):
        return TorchDistTransport(group, device)
    try:
        target = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; available: gloo, nccl, {', '.join(TRANSPORTS)}") from None
    module_name, cls_name = target.split(":")
    return getattr(importlib.import_module(module_name), cls_name)(plan, group, device)
