"""Can a layer's forward be captured in a CUDA graph? Read from the forward oracle, before any graph exists.

Why here and not at capture: the torch forward (ep_size > 1 over nccl / gloo / mori, the torch
experts) reads row counts on the host and raises "cannot be captured" inside the engine's capture,
after minutes of start-up and with a stack trace that names no flag. The engines know at start-up
whether they will capture (vLLM without --enforce-eager, SGLang without --disable-cuda-graph); with
the oracle's answer (plan/forward_choice.py: ``ForwardChoice.capturable``) the plugins refuse the
start instead, naming the flag. This module only words that refusal; it decides nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from .forward_choice import P2P_TRANSPORTS, ForwardChoice


class GraphCaptureError(ValueError):
    """The engine will capture CUDA graphs and this layer's forward cannot be captured."""


@dataclass(frozen=True)
class EngineGraphs:
    """What the engine will do with CUDA graphs around the MoE op, and the flag that turns them off.

    Each plugin builds it from its engine's own configuration (vLLM: --enforce-eager / the cudagraph
    mode; SGLang: --disable-cuda-graph) and hands it to the layer, which decides with it once its
    transport is settled (layer/startup.py): one rule for both engines."""

    captures: bool
    eager_flag: str  # vLLM "--enforce-eager", SGLang "--disable-cuda-graph"


def require_capturable(choice: ForwardChoice, eager_flag: str, transport_why: str = "") -> None:
    """Raise GraphCaptureError naming ``eager_flag`` when the oracle says the engine captures
    (``choice.engine_captures``) and the forward cannot be captured; nothing otherwise. A pending
    choice (MEGA_DISPATCH=auto before the EP group settled it) is not judged: ValueError.
    ``transport_why``: how the transport was chosen (the plan's reason line), quoted so the operator
    sees what MEGA_DISPATCH=auto found."""
    if choice.pending and choice.engine_captures and choice.device != "cpu":
        raise ValueError("MEGA_DISPATCH=auto is still waiting for the EP group's topology: the capture check runs on "
                         "the settled plan (megamoe_backend.layer.startup.settle_plan), not on a pending one")
    if not choice.refused_by_engine:
        return
    where = " | ".join(P2P_TRANSPORTS)
    chosen = f" [{transport_why}]" if transport_why else ""
    raise GraphCaptureError(
        f"[megamoe] {choice.why}{chosen}, so the MoE layers cannot be captured in the CUDA graphs this engine is set to "
        f"capture. Add {eager_flag} to run eagerly, or serve EP over the device P2P forward "
        f"(MEGA_DISPATCH={where}, ranks of one host, Triton experts)."
    )
