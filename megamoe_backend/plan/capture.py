"""Can a layer's forward be captured in a CUDA graph? Decided from the plan, before any graph exists.

Why here and not at capture: the torch forward (ep_size > 1 over nccl / gloo / mori, the fused
aiter runtime, the torch experts) reads row counts on the host and raises "cannot be captured"
inside the engine's capture, after minutes of start-up and with a stack trace that names no flag.
The engines know at start-up whether they will capture (vLLM without --enforce-eager, SGLang
without --disable-cuda-graph); with this answer the plugins refuse the start instead, naming the
flag. Pure: the facts are plain values, so CPU tests inject every platform.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

P2P_TRANSPORTS = ("symm", "ipc")  # the device forward's transports at ep_size > 1 (peer arenas)
# ... and every transport a sync-free forward runs over at ep_size > 1: the peer arenas, and mori
# (ROCm; layer/forwards/mori.py keeps mori's counts on the device)
DEVICE_EP_TRANSPORTS = P2P_TRANSPORTS + ("mori",)


class GraphCaptureError(ValueError):
    """The engine will capture CUDA graphs and this layer's forward cannot be captured."""


@dataclass(frozen=True)
class CaptureFacts:
    """What decides which forward a layer runs (``runs_device_forward``, which MegaMoELayer asks too)."""

    device_type: str  # "cpu" | "cuda" | "rocm"
    provider: str  # experts provider: "triton" | "torch" | "aiter"
    transport: str  # plan.backends.transport: "symm" | "ipc" | "nccl" | "gloo" | "mori"
    ep_size: int
    fused: bool = False  # aiter's fused runtime owns dispatch, experts and combine

    @classmethod
    def of(cls, plan: Any, device_type: str) -> "CaptureFacts":
        """The facts of a settled plan. A plan whose MEGA_DISPATCH=auto still waits for the EP group
        (``needs_ep_topology``) holds a placeholder transport: asking it would judge the placeholder,
        so it is refused (the layer settles the plan first: layer/startup.py)."""
        b = plan.backends
        if b.needs_ep_topology and device_type != "cpu":
            raise ValueError("MEGA_DISPATCH=auto is still waiting for the EP group's topology: the capture check runs on "
                             "the settled plan (megamoe_backend.layer.startup.settle_plan), not on this placeholder")
        return cls(device_type, b.provider, b.transport, plan.ep_size, bool(b.fused))


def runs_device_forward(facts: CaptureFacts) -> bool:
    """The layer takes the sync-free device forward: a GPU, the Triton experts (not aiter's fused
    runtime), at ep_size 1, over peer arenas (MEGA_DISPATCH=symm | ipc) or over mori (ROCm). The
    one rule: the layer picks its forward by it, and the engines' start-up check below is its
    negation off the CPU (aiter's fused runtime, sync-free too, is the other capturable forward)."""
    return (facts.device_type != "cpu" and not facts.fused and facts.provider == "triton"
            and (facts.ep_size == 1 or facts.transport in DEVICE_EP_TRANSPORTS))


def uncapturable_reason(facts: CaptureFacts) -> str | None:
    """Why this layer's forward cannot be captured, or None when it can (the sync-free device
    forward: Triton experts at ep_size 1 or over peer arenas) or when nothing is captured (CPU)."""
    if facts.device_type == "cpu" or runs_device_forward(facts) or facts.fused:
        return None  # CPU: CUDA graphs only exist on GPUs; fused: aiter's runtime keeps its counts on the device
    if facts.provider != "triton":
        return f"the {facts.provider} experts run the torch forward, which reads row counts on the host"
    return (f"EP over MEGA_DISPATCH={facts.transport} (ep_size {facts.ep_size}) runs the torch forward, which "
            "exchanges row counts on the host")


@dataclass(frozen=True)
class EngineGraphs:
    """What the engine will do with CUDA graphs around the MoE op, and the flag that turns them off.

    Each plugin builds it from its engine's own configuration (vLLM: --enforce-eager / the cudagraph
    mode; SGLang: --disable-cuda-graph) and hands it to the layer, which decides with it once its
    transport is settled (layer/startup.py): one rule for both engines."""

    captures: bool
    eager_flag: str  # vLLM "--enforce-eager", SGLang "--disable-cuda-graph"


def require_capturable(facts: CaptureFacts, engine_captures: bool, eager_flag: str, transport_why: str = "") -> None:
    """Raise GraphCaptureError naming ``eager_flag`` when the engine will capture graphs and the
    layer cannot be captured; nothing otherwise. ``transport_why``: how the transport was chosen
    (the plan's reason line), quoted so the operator sees what MEGA_DISPATCH=auto found."""
    reason = uncapturable_reason(facts)
    if reason is None or not engine_captures:
        return
    where = " | ".join(P2P_TRANSPORTS)
    chosen = f" [{transport_why}]" if transport_why else ""
    raise GraphCaptureError(
        f"[megamoe] {reason}{chosen}, so the MoE layers cannot be captured in the CUDA graphs this engine is set to "
        f"capture. Add {eager_flag} to run eagerly, or serve EP over the device P2P forward "
        f"(MEGA_DISPATCH={where}, ranks of one host, Triton experts)."
    )
