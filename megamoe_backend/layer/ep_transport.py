"""MEGA_DISPATCH=auto on CUDA, completed with the layer's EP group: ipc / symm or nccl.

Why here: the plan is built before any process group exists (engines build it at weight loading,
``megamoe info`` without one), so selection (platform/select.py) leaves auto's EP transport open
(``Selection.transport`` is PENDING_EP_GROUP: ``needs_ep_topology``). The layer has the group: it gathers every rank's place
(platform/topology.py), asks the same pure rule (``cuda_auto_transport``) and, before trusting
ipc / symm, runs the peer-arena handshake on a tiny arena (transport/handshake.py); a failed
handshake means nccl, never a failed start. Every step is collective and its outcome the same on
every rank, so the ranks agree on the transport. Decided once per group (transport/cache.py) and
logged once, with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..plan import LayerPlan
from ..platform import facts as platform_facts
from ..platform.select import cuda_auto_transport
from ..platform.topology import EpTopology, gather_ep_topology
from ..transport.cache import get_ep_transport
from ..transport.handshake import probe_peer_arenas

logger = logging.getLogger("megamoe")


@dataclass(frozen=True)
class EpTransportChoice:
    transport: str  # "ipc" | "symm" | "nccl"
    why: str


def decide_ep_transport(plan: LayerPlan, group: Any, device: torch.device,
                        gather: Callable[[Any, torch.device], EpTopology] | None = None,
                        probe: Callable[[str, Any, torch.device, float], str | None] | None = None,
                        ) -> EpTransportChoice:
    """Collective over ``group``: topology, the rule, and the handshake where the rule picks ipc / symm.

    ``gather`` / ``probe`` default to this module's ``gather_ep_topology`` / ``probe_peer_arenas``,
    looked up at the call: the two facts only the EP group can give, which CPU tests of the engines'
    start-up replace there (everything else they run is what a GPU host runs)."""
    gather = gather or gather_ep_topology
    probe = probe or probe_peer_arenas
    transport, why = cuda_auto_transport(plan.backends.provider, plan.ep_size, gather(group, device))
    failure = probe(transport, group, device, plan.knobs.p2p_timeout_s) if transport in ("ipc", "symm") else None
    if failure is not None:
        transport, why = "nccl", f"{why}; but the peer-arena handshake over {transport} failed, so nccl (eager): {failure}"
    elif transport != "nccl":
        why += "; peer-arena handshake passed"
    log = logger.info if failure is None else logger.warning
    log(f"[megamoe] ep_rank {plan.ep_rank}: transport {transport} (MEGA_DISPATCH=auto): {why}")
    return EpTransportChoice(transport, why)


def resolve_ep_transport(plan: LayerPlan, group: Any, device: torch.device, decide=decide_ep_transport,
                         kind: str | None = None) -> LayerPlan:
    """``plan`` with auto's EP transport decided (once per group); plans that chose already pass through.
    ``kind``: the device's platform (platform.facts.device_kind), "cuda" where auto waits for the group."""
    selection = plan.backends
    kind = kind or platform_facts.device_kind(torch.device(device))
    if not selection.needs_ep_topology or group is None or kind != "cuda":
        return plan
    choice = get_ep_transport(group, device, lambda: decide(plan, group, device))
    reasons = tuple(r for r in selection.reasons if not r.startswith("transport "))
    reasons += (f"transport {choice.transport} (MEGA_DISPATCH=auto): {choice.why}",)
    backends = dataclasses.replace(selection, transport=choice.transport, reasons=reasons)
    return dataclasses.replace(plan, backends=backends)
