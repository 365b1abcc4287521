"""The layer's start-up decision: what moves its rows, and whether the engine may capture it.

Why one place, in the layer: the capture rule can only judge the transport the layer will really
use, and with MEGA_DISPATCH=auto that is known only after the EP group gathered its topology and
passed (or failed) the peer-arena handshake (layer/ep_transport.py). Checked earlier, on the
selection's pending answer (then a placeholder nccl), the rule refused every GPU EP start with the
defaults. The rule itself is the forward oracle's (plan/forward_choice.py: ``forward_choice`` below
asks it with the facts a GPU host reads; the layer builds the same answer). Both plugins hand the
layer their engine's ``EngineGraphs``; the decision here runs before any buffer of the layer exists,
and its inputs are agreed over the EP group, so every rank starts, or every rank refuses naming the flag.
"""

from __future__ import annotations

from typing import Any

import dataclasses

import torch

from ..plan import LayerPlan
from ..plan.capture import EngineGraphs, require_capturable
from ..plan.forward_choice import ForwardChoice, ForwardFacts, choose_forward
from ..platform import facts as platform_facts
from . import ep_transport


def transport_reason(plan: LayerPlan) -> str:
    """The plan's line on how its transport was chosen ("transport X (MEGA_DISPATCH=...): why")."""
    return next((r for r in plan.backends.reasons if r.startswith("transport ")), "")


def forward_choice(plan: LayerPlan, device: torch.device, *, provider: str | None = None,
                   engine_captures: bool | None = None, device_forward: bool | None = None,
                   transport_given: bool = False) -> ForwardChoice:
    """The oracle's answer for ``plan`` on ``device`` (plan/forward_choice.py), the facts read where a GPU
    host reads them (``platform.facts.device_kind``, which CPU tests of the start-up replace)."""
    facts = ForwardFacts.of(plan, platform_facts.device_kind(device), provider=provider, engine_captures=engine_captures,
                            device_forward=device_forward, transport_given=transport_given)
    return choose_forward(facts)


def settle_plan(plan: LayerPlan, group: Any, device: torch.device, graphs: EngineGraphs | None,
                provider: str | None = None) -> LayerPlan:
    """``plan`` with MEGA_DISPATCH=auto resolved over ``group`` (a collective, once per group), then
    refused with GraphCaptureError when ``graphs`` says the engine captures and the settled forward
    cannot be captured. ``graphs`` None: the caller captures nothing (benchmarks, tests, eager use).
    ``provider``: the experts provider's name where the caller injected one."""
    kind = platform_facts.device_kind(device)
    plan = ep_transport.resolve_ep_transport(plan, group, device, kind=kind)
    if graphs is not None:
        choice = forward_choice(plan, device, provider=provider, engine_captures=graphs.captures)
        require_capturable(choice, graphs.eager_flag, transport_reason(plan))
        plan = dataclasses.replace(plan, engine_graphs=choice.engine_graphs)
    return plan
