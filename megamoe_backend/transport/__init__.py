"""Transports: how dispatch and combine rows move between EP ranks."""

from .base import DispatchHandle, DispatchResult, PeerInputError, PeerTimeoutError, Transport, TransportError
from .cache import cached_transport_keys, clear_transport_cache, get_transport, transport_key
from .layout import DispatchLayout, received_pairs
from .torch_dist import LocalTransport, TorchDistTransport

__all__ = [
    "DispatchHandle",
    "DispatchLayout",
    "DispatchResult",
    "LocalTransport",
    "PeerInputError",
    "PeerTimeoutError",
    "TorchDistTransport",
    "Transport",
    "TransportError",
    "cached_transport_keys",
    "clear_transport_cache",
    "get_transport",
    "received_pairs",
    "transport_key",
]
