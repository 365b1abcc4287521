"""The GPU-host facts the engines' start-up tests inject on CPU (tests/vllm, tests/sglang workers).

Only what hardware or the EP group can tell is replaced, where the code reads it: the device's
platform (``platform.facts.device_kind`` -> "cuda"), the EP group's gathered topology and the
peer-arena probe (``layer.ep_transport``). The plan is then selected from this machine's real
facts as a CUDA host (Triton importable), and the plugin's own start-up runs unchanged up to the
layer's decision (``layer.startup.settle_plan``, the code a GPU host runs); the spy below records
the settled plan and stops there, before the layer would allocate GPU buffers this CPU has not.
Expected outcomes are written out per case, not recomputed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class StartupCase:
    name: str
    dispatch: str  # MEGA_DISPATCH
    hosts: int  # hosts the EP ranks are spread over
    peer_access: bool
    probe_fails: bool
    graphs: bool  # the engine captures CUDA graphs
    expect: str  # the settled transport, or "refused"


CASES = (
    StartupCase("default", "auto", 1, True, False, True, "symm"),  # vLLM's / SGLang's defaults on one host
    StartupCase("default-eager", "auto", 1, True, False, False, "symm"),
    StartupCase("two-hosts", "auto", 2, True, False, True, "refused"),
    StartupCase("two-hosts-eager", "auto", 2, True, False, False, "nccl"),
    StartupCase("no-peer-access", "auto", 1, False, False, True, "refused"),
    StartupCase("handshake-fails", "auto", 1, True, True, True, "refused"),
    StartupCase("handshake-fails-eager", "auto", 1, True, True, False, "nccl"),
    StartupCase("ipc", "ipc", 1, True, False, True, "ipc"),
    StartupCase("symm", "symm", 1, True, False, True, "symm"),
    StartupCase("nccl", "nccl", 1, True, False, True, "refused"),
    StartupCase("nccl-eager", "nccl", 1, True, False, False, "nccl"),
)


class Settled(Exception):
    """Raised by the spy once the layer's start-up decision is made (carries the settled plan)."""

    def __init__(self, plan):
        super().__init__("settled")
        self.plan = plan


def inject(case: StartupCase, rank: int, world: int) -> None:
    """Set the case's knob and facts in this rank's process (call before the plugin builds the layer)."""
    from megamoe_backend.layer import ep_transport, startup
    from megamoe_backend.platform import facts as platform_facts
    from megamoe_backend.platform.topology import EpTopology, RankPlace
    from megamoe_backend.transport import clear_transport_cache

    clear_transport_cache()  # auto's decision is cached per EP group: every case decides anew
    os.environ["MEGA_DISPATCH"] = case.dispatch
    gpus = [f"GPU-{r}" for r in range(world)]
    places = tuple(RankPlace(f"host{r * case.hosts // world}/boot", gpus[r],
                             tuple(gpus) if case.peer_access else (gpus[r],), True) for r in range(world))
    platform_facts.device_kind = lambda device: "cuda"
    ep_transport.gather_ep_topology = lambda group, device: EpTopology(places)
    failure = (f"[megamoe] MEGA_DISPATCH=symm: the symmetric memory rendezvous failed on 1 of {world} rank(s) "
               f"(ep_rank {world - 1}: injected)")
    ep_transport.probe_peer_arenas = lambda kind, group, device, timeout_s: failure if case.probe_fails else None
    real = getattr(startup, "_real_settle_plan", startup.settle_plan)
    startup._real_settle_plan = real

    def spy(*args, **kwargs):
        raise Settled(real(*args, **kwargs))
    startup.settle_plan = spy


def outcome(build) -> dict:
    """Run ``build()`` (the plugin's start-up of one layer): what the layer decided, or the refusal."""
    from megamoe_backend.plan.capture import GraphCaptureError

    try:
        build()
    except Settled as done:
        return {"transport": done.plan.backends.transport, "reasons": list(done.plan.backends.reasons)}
    except GraphCaptureError as exc:
        return {"refused": str(exc)}
    return {"error": "the layer was built without its start-up decision"}


def check_case(case: StartupCase, answers: list[dict], eager_flag: str) -> None:
    """Every rank decided the same way, and as the case expects: the transport it settled on, or a
    refusal naming the engine's flag (and the failed handshake where one failed)."""
    assert all(a == answers[0] for a in answers), answers
    got = answers[0]
    assert "error" not in got, got
    if case.expect == "refused":
        text = got.get("refused", f"started over {got.get('transport')}")
        assert f"Add {eager_flag} to run eagerly" in text and "MEGA_DISPATCH=" in text, text
        if case.probe_fails:
            assert "handshake over symm failed" in text and "ep_rank 1: injected" in text, text
    else:
        assert got.get("transport") == case.expect, got
