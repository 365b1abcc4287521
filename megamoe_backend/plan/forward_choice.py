"""Which forward a layer runs, decided once from plain facts: the forward oracle.

Why one function: the forward decides everything downstream -- which object the layer builds
(layer/megamoe_layer.py), whether an engine may capture it (plan/capture.py), whether the engines
pass the token bound (plan/token_bound.py), what the startup line and ``megamoe info`` say. Decided
in each of those places, they disagreed (issue 59); here they read one ``ForwardChoice``. Pure: the
facts are plain values, so CPU tests inject every platform and run the code the GPU host runs.

MEGA_DISPATCH=auto on CUDA with more than one EP rank is decided over the EP group at start-up
(layer/ep_transport.py); until then selection answers ``PENDING_EP_GROUP`` and so does this oracle:
a pending forward is an answer (what auto may pick, both take the bound, capture not yet judgeable),
not a placeholder transport judged as if it were chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..platform.select import PENDING_EP_GROUP

P2P_TRANSPORTS = ("symm", "ipc")  # the device forward's transports at ep_size > 1 (peer arenas)
# ... and every transport a sync-free forward runs over at ep_size > 1: the peer arenas, and mori
# (ROCm; layer/forwards/mori.py keeps mori's counts on the device)
DEVICE_EP_TRANSPORTS = P2P_TRANSPORTS + ("mori",)
FORWARDS = ("device", "p2p", "mori", "torch", "fused", "pending")
# the experts providers that run sync-free on a GPU: the plan names "triton"; a caller may inject humming's
# (experts/humming/, whose GEMMs experts/gemm_choice.py may pick inside the plan's "triton" too)
DEVICE_PROVIDERS = ("triton", "humming")


@dataclass(frozen=True)
class ForwardFacts:
    """What decides a layer's forward. ``transport``: the settled one, or PENDING_EP_GROUP.

    ``device_forward``: the caller's override (MegaMoELayer(device_path=)): True asks for a device
    forward (the Triton interpreter on CPU, the one-process emulator), False for the torch forward;
    None lets the facts decide. ``transport_given``: the caller handed the layer a Transport (tests,
    benchmarks): the torch forward runs over it unless a device forward was asked for.
    ``engine_captures``: the engine's CUDA-graph setting (EngineGraphs.captures), None when no engine
    said (benchmarks, tests, eager use). ``scheme``: the experts' quant scheme, named in ``why``."""

    device: str  # "cpu" | "cuda" | "rocm" (platform.facts.device_kind)
    provider: str  # experts provider: "triton" | "torch" | "aiter"
    transport: str  # "symm" | "ipc" | "nccl" | "gloo" | "mori" | PENDING_EP_GROUP
    ep_size: int
    fused: bool = False  # aiter's fused runtime owns dispatch, experts and combine
    engine_captures: bool | None = None
    scheme: str = ""
    device_forward: bool | None = None
    transport_given: bool = False

    @classmethod
    def of(cls, plan: Any, device: str, *, provider: str | None = None, engine_captures: bool | None = None,
           device_forward: bool | None = None, transport_given: bool = False) -> "ForwardFacts":
        """The facts of ``plan`` on a ``device`` kind; ``provider``: the experts provider's name where the
        caller injected one (default: the plan's)."""
        b = plan.backends
        return cls(device, provider or b.provider, b.transport, plan.ep_size, bool(b.fused), engine_captures,
                   plan.math.quant, device_forward, transport_given)


@dataclass(frozen=True)
class ForwardChoice:
    """The one answer: which forward (``forward``, one of FORWARDS), with which experts over which
    transport; ``capturable``: whether a CUDA-graph capture can hold it (None while pending);
    ``takes_token_bound``: whether ``forward(max_tokens_across_ranks=)`` applies; ``why`` in words."""

    forward: str
    provider: str
    transport: str
    capturable: bool | None
    takes_token_bound: bool
    why: str
    device: str = "cpu"
    engine_captures: bool | None = None

    @property
    def pending(self) -> bool:
        return self.forward == "pending"

    @property
    def moves_rows(self) -> str:
        """What moves the rows, as the layer's startup line says it (``transport=``)."""
        return {"device": "device", "p2p": f"device p2p over {self.transport}", "mori": "device mori",
                "fused": "fused"}.get(self.forward, self.transport)

    @property
    def engine_graphs(self) -> str | None:
        """What the engine does with this layer's CUDA graphs (LayerPlan.engine_graphs, the startup line's
        ``graphs=``): "captured", "eager", or None where no engine said. CPU: nothing is captured."""
        if self.engine_captures is None:
            return None
        return "captured" if self.engine_captures and self.device != "cpu" else "eager"

    @property
    def refused_by_engine(self) -> bool:
        """The engine captures and this forward cannot be captured: the start is refused (plan/capture.py)."""
        return bool(self.engine_captures) and self.capturable is False


def choose_forward(f: ForwardFacts) -> ForwardChoice:
    """The forward for ``f``; ValueError (naming the knob and the fix) where no forward can serve.

    The sync-free device forwards run on a GPU with the Triton experts: at ep_size 1 (device), over
    peer arenas (MEGA_DISPATCH=symm | ipc: p2p) or over mori (ROCm: mori); aiter's fused runtime
    (ROCm) is sync-free too. All are capturable; every one that exchanges rows takes the token
    bound (P2P: sizes its receive rows by it; mori: its tile config; fused: its runtime and aiter's
    config bucket, as aiter's ``config_tokens`` / ATOM's ``recv_token_bound`` take it, docs/rocm.md).
    Anything else is the torch forward (host row counts: eager only), which takes the bound too,
    to check it and agree on it through its dispatch header."""
    if f.fused:
        return _answer(f, "fused", True, True, "aiter's fused MegaMoE runtime: dispatch, both GEMMs and combine, counts "
                       "on the device; the runtime per step from the engine's token bound")
    if f.transport == PENDING_EP_GROUP and not f.transport_given:
        return _answer(f, "pending", None, True,
                       "MEGA_DISPATCH=auto waits for the EP group's topology: the device P2P forward over symm / ipc "
                       "(capturable) when every EP rank is on one host with CUDA peer access and the peer-arena "
                       "handshake passes, else the torch forward over nccl (eager); both take the token bound")
    if f.device_forward is None:
        sync_free = (not f.transport_given and f.device != "cpu" and f.provider in DEVICE_PROVIDERS
                     and (f.ep_size == 1 or f.transport in DEVICE_EP_TRANSPORTS))
    else:
        sync_free = f.device_forward
    if sync_free:
        return _device_choice(f)
    if f.transport in P2P_TRANSPORTS and not f.transport_given:
        asked = ", the torch forward asked for" if f.device_forward is False else ""
        raise ValueError(
            f"MEGA_DISPATCH={f.transport} is the device P2P forward: it needs CUDA and the triton experts (this layer: "
            f"device {f.device}, experts {f.provider}{asked}); use MEGA_DISPATCH=nccl (or gloo on CPU) otherwise")
    return _answer(f, "torch", f.device == "cpu", True, _torch_why(f))


def _answer(f: ForwardFacts, forward: str, capturable: bool | None, takes_bound: bool, why: str) -> ForwardChoice:
    return ForwardChoice(forward, f.provider, f.transport, capturable, takes_bound, why, f.device, f.engine_captures)


def _device_choice(f: ForwardFacts) -> ForwardChoice:
    scheme = f" {f.scheme}" if f.scheme else ""
    if f.ep_size == 1:
        forward, why = "device", f"the device forward: Triton{scheme} experts on this GPU alone, no exchange"
    elif f.transport in P2P_TRANSPORTS:
        forward, why = "p2p", f"the device P2P forward over {f.transport} peer arenas, Triton{scheme} experts"
    elif f.transport == "mori":
        forward, why = "mori", f"the mori device forward (counts on the device), Triton{scheme} experts"
    else:
        raise ValueError(f"the device forward runs at ep_size 1 or over MEGA_DISPATCH=symm | ipc (this plan: ep_size "
                         f"{f.ep_size}, transport {f.transport})")
    return _answer(f, forward, True, f.ep_size > 1, why)


def _torch_why(f: ForwardFacts) -> str:
    """Why the torch forward; off the CPU this is the capture refusal's reason (plan/capture.py)."""
    if f.device == "cpu":
        return f"cpu: the torch forward over {f.transport} (nothing is captured on CPU)"
    if f.device_forward is False or f.transport_given:
        return "the caller asked for the torch forward, which reads row counts on the host"
    if f.provider not in DEVICE_PROVIDERS:
        return f"the {f.provider} experts run the torch forward, which reads row counts on the host"
    return (f"EP over MEGA_DISPATCH={f.transport} (ep_size {f.ep_size}) runs the torch forward, which exchanges row "
            "counts on the host")
