"""Which experts provider and which transport run, and why — the plan's view of the platform.

The decision itself is pure and lives in :mod:`megamoe_backend.platform` (facts in, Selection
out); this module only turns a device kind ("cpu" | "cuda" | "rocm") into platform facts, so the
plan, `megamoe info --device X` and tests can ask "what would run there".
"""

from __future__ import annotations

import dataclasses

from ..experts.base import ExpertMath
from ..knobs import Knobs
from ..platform import PlatformFacts, Selection, detect_facts
from ..platform import select_backends as select_for_facts
from ..platform.topology import EpTopology

# The plan's name for the selection result (provider, transport, reasons, mtpr, fused runtime).
BackendChoice = Selection


def facts_for(device_type: str) -> PlatformFacts:
    """This machine's facts, with the device kind overridden when planning for another one."""
    if device_type not in ("cpu", "cuda", "rocm"):
        raise ValueError(f"device_type={device_type!r}; expected cpu, cuda or rocm")
    facts = detect_facts()
    if facts.device != device_type:
        facts = dataclasses.replace(facts, device=device_type)
    return facts


def select_backends(
    knobs: Knobs,
    math: ExpertMath,
    device_type: str,
    *,
    ep_size: int | None = None,
    num_experts: int | None = None,
    facts: PlatformFacts | None = None,
    topology: EpTopology | None = None,
) -> Selection:
    """``facts`` replaces this machine's; ``topology`` (the EP group's, platform/topology.py) completes
    MEGA_DISPATCH=auto on CUDA, which without it waits for the layer's EP group."""
    facts = facts or facts_for(device_type)
    if topology is not None:
        facts = dataclasses.replace(facts, ep_topology=topology)
    return select_for_facts(facts, knobs, math, ep_size=ep_size, num_experts=num_experts)


def manual_choice(provider: str, transport: str, knobs: Knobs, reason: str = "chosen by the caller") -> Selection:
    """A Selection fixed by the caller (plugins that know their transport, tests)."""
    return Selection(
        provider=provider, transport=transport, dispatch_wire=knobs.dispatch_wire, combine_wire=knobs.combine_wire,
        mtpr=knobs.max_tokens_per_rank, reasons=(reason,),
    )
