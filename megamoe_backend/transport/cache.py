"""The transport cache: the one piece of global mutable state, by design.

Why: a transport owns communication buffers sized by the plan (hidden, top-k, MTPR, wires, EP
size); every MoE layer of a model has the same shapes, so all layers share one transport instead
of allocating 60 copies. The key holds everything that changes the buffer layout, the wire
included, so a layer with a different wire never reuses a buffer laid out for another.
"""

from __future__ import annotations

from typing import Callable

import torch

from .base import Transport

_TRANSPORTS: dict[tuple, Transport] = {}


def transport_key(layout_key: tuple, group: object, device: torch.device) -> tuple:
    return (layout_key, id(group), str(device))


def get_transport(layout_key: tuple, group: object, device: torch.device, factory: Callable[[], Transport]) -> Transport:
    key = transport_key(layout_key, group, device)
    transport = _TRANSPORTS.get(key)
    if transport is None:
        transport = factory()
        _TRANSPORTS[key] = transport
    return transport


def cached_transport_keys() -> list[tuple]:
    return list(_TRANSPORTS)


def clear_transport_cache() -> None:
    """Drop all cached transports (process-group teardown, tests)."""
    _TRANSPORTS.clear()
