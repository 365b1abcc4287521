"""The layer's start-up decision: what moves its rows, and whether the engine may capture it.

Why one place, in the layer: the capture rule can only judge the transport the layer will really
use, and with MEGA_DISPATCH=auto that is known only after the EP group gathered its topology and
passed (or failed) the peer-arena handshake (layer/ep_transport.py). Checked earlier, on the plan's
placeholder, the rule refused every GPU EP start with the defaults. Both plugins hand the layer
their engine's ``EngineGraphs``; the decision here runs before any buffer of the layer exists, and
its inputs are agreed over the EP group, so every rank starts, or every rank refuses naming the flag.
"""

from __future__ import annotations

from typing import Any

import dataclasses

import torch

from ..plan import LayerPlan
from ..plan.capture import CaptureFacts, EngineGraphs, require_capturable
from ..platform import facts as platform_facts
from . import ep_transport


def transport_reason(plan: LayerPlan) -> str:
    """The plan's line on how its transport was chosen ("transport X (MEGA_DISPATCH=...): why")."""
    return next((r for r in plan.backends.reasons if r.startswith("transport ")), "")


def settle_plan(plan: LayerPlan, group: Any, device: torch.device, graphs: EngineGraphs | None) -> LayerPlan:
    """``plan`` with MEGA_DISPATCH=auto resolved over ``group`` (a collective, once per group), then
    refused with GraphCaptureError when ``graphs`` says the engine captures and the settled forward
    cannot be captured. ``graphs`` None: the caller captures nothing (benchmarks, tests, eager use)."""
    kind = platform_facts.device_kind(device)
    plan = ep_transport.resolve_ep_transport(plan, group, device, kind=kind)
    if graphs is not None:
        require_capturable(CaptureFacts.of(plan, kind), graphs.captures, graphs.eager_flag, transport_reason(plan))
        plan = dataclasses.replace(plan, engine_graphs="captured" if graphs.captures and kind != "cpu" else "eager")
    return plan
