"""Which experts provider and which transport run, and why — the plan's view of the platform.

The decision itself is pure and lives in :mod:`megamoe_backend.platform` (``select_backends``: facts
in, Selection out); this module only turns a device kind ("cpu" | "cuda" | "rocm") into platform
facts and calls it (``select_for_device``), so the plan, `megamoe info --device X` and tests can ask
"what would run there".
"""

from __future__ import annotations

import dataclasses

from ..experts.base import ExpertMath
from ..knobs import Knobs
from ..platform import MoEShape, PlatformFacts, RocmAsk, Selection, detect_facts, probe_aiter_caps
from ..platform import select_backends
from ..platform.topology import EpTopology

# The plan's name for the selection result (provider, transport, reasons, mtpr, fused runtime).
BackendChoice = Selection


def facts_for(device_type: str, gfx_arch: str | None = None) -> PlatformFacts:
    """This machine's facts, with the device kind overridden when planning for another one.

    ``gfx_arch`` (``megamoe info --gfx-arch``): plan for that AMD GPU with the aiter / mori installed
    here, their MegaMoE classes read as on that box (``probe_aiter_caps``)."""
    if device_type not in ("cpu", "cuda", "rocm"):
        raise ValueError(f"device_type={device_type!r}; expected cpu, cuda or rocm")
    facts = detect_facts()
    if facts.device != device_type:
        facts = dataclasses.replace(facts, device=device_type)
    if gfx_arch is not None and gfx_arch != facts.gfx_arch:
        if device_type != "rocm":
            raise ValueError(f"--gfx-arch {gfx_arch} plans for an AMD GPU: use --device rocm")
        caps = facts.aiter_caps if facts.aiter_caps.has_v2 or not facts.has("aiter") else probe_aiter_caps()
        facts = dataclasses.replace(facts, gfx_arch=gfx_arch, aiter_caps=caps, gpu_count=facts.gpu_count or 8)
    return facts


def current_device_index(facts: PlatformFacts) -> int | None:
    """This process's GPU index on a ROCm GPU host (MegaMoEV2 allocates on cuda:<ep_rank>), else None."""
    if facts.device != "rocm" or facts.torch_build != "rocm":
        return None
    import torch

    return int(torch.cuda.current_device()) if torch.cuda.is_available() else None


def select_for_device(
    knobs: Knobs,
    math: ExpertMath,
    device_type: str,
    *,
    ep_size: int | None = None,
    num_experts: int | None = None,
    facts: PlatformFacts | None = None,
    topology: EpTopology | None = None,
    shape: MoEShape | None = None,
    ep_rank: int | None = None,
) -> Selection:
    """``platform.select_backends`` for a ``device_type``. ``facts`` replaces this machine's; ``topology``
    (the EP group's, platform/topology.py) completes MEGA_DISPATCH=auto on CUDA, which without it waits
    for the layer's EP group. ``shape`` and ``ep_rank``: what the ROCm branches ask aiter's plan builder
    and check MegaMoEV2's device by."""
    facts = facts or facts_for(device_type)
    if topology is not None:
        facts = dataclasses.replace(facts, ep_topology=topology)
    rocm = RocmAsk(shape=shape, ep_rank=ep_rank, device_index=current_device_index(facts))
    return select_backends(facts, knobs, math, ep_size=ep_size, num_experts=num_experts, rocm=rocm)


def manual_choice(provider: str, transport: str, knobs: Knobs, reason: str = "chosen by the caller") -> Selection:
    """A Selection fixed by the caller (plugins that know their transport, tests)."""
    return Selection(
        provider=provider, transport=transport, dispatch_wire=knobs.dispatch_wire, combine_wire=knobs.combine_wire,
        mtpr=knobs.max_tokens_per_rank, reasons=(reason,),
    )
