"""The transport cache: the one piece of global mutable state, by design.

Why: a transport owns communication buffers sized by the plan (hidden, top-k, MTPR, wires, EP
size); every MoE layer of a model has the same shapes, so all layers share one transport instead
of allocating 60 copies. The key holds everything that changes the buffer layout, the wire
included, so a layer with a different wire never reuses a buffer laid out for another. The
device workspaces of the sync-free forward (layer/device/workspace.py) are cached beside the
transports, under the same key, for the same reason. What MEGA_DISPATCH=auto resolved to for an
EP group (a collective decision, layer/ep_transport.py) is kept here too, so 61 layers decide once.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import Transport

_TRANSPORTS: dict[tuple, Transport] = {}
_WORKSPACES: dict[tuple, Any] = {}
_EP_TRANSPORTS: dict[tuple, Any] = {}  # MEGA_DISPATCH=auto's decision per EP group (layer/ep_transport.py)


def transport_key(layout_key: tuple, group: object, device: torch.device) -> tuple:
    return (layout_key, id(group), str(device))


def get_transport(layout_key: tuple, group: object, device: torch.device, factory: Callable[[], Transport]) -> Transport:
    key = transport_key(layout_key, group, device)
    transport = _TRANSPORTS.get(key)
    if transport is None:
        transport = factory()
        _TRANSPORTS[key] = transport
    return transport


def get_workspace(layout_key: tuple, group: object, device: torch.device, factory: Callable[[], Any]) -> tuple[Any, bool]:
    """(workspace, created now): the device buffers shared by every layer of this shape."""
    key = transport_key(layout_key, group, device)
    workspace = _WORKSPACES.get(key)
    if workspace is not None:
        return workspace, False
    workspace = _WORKSPACES[key] = factory()
    return workspace, True


def get_ep_transport(group: object, device: torch.device, factory: Callable[[], Any]) -> Any:
    """What MEGA_DISPATCH=auto resolved to for this EP group: decided once (a collective), reused by every layer."""
    key = (id(group), str(device))
    if key not in _EP_TRANSPORTS:
        _EP_TRANSPORTS[key] = factory()
    return _EP_TRANSPORTS[key]


def cached_transport_keys() -> list[tuple]:
    return list(_TRANSPORTS)


def clear_transport_cache() -> None:
    """Drop all cached transports and workspaces (process-group teardown, tests)."""
    _TRANSPORTS.clear()
    _WORKSPACES.clear()
    _EP_TRANSPORTS.clear()
