"""The layer's start-up decision (layer/startup.py: ``settle_plan``) on a CUDA host, on CPU with the
facts injected: what a GPU host with the defaults (and every MEGA_DISPATCH) starts or refuses.

The injected facts are the ones only hardware or the EP group can give, replaced where the code
reads them: the device's platform (``platform.facts.device_kind``), the platform facts the plan is
selected from (CUDA + Triton), the EP group's gathered topology and the peer-arena probe
(``layer.ep_transport.gather_ep_topology`` / ``probe_peer_arenas``). Everything else is the code a
GPU host runs. Expected outcomes are written out by hand per case, not recomputed.

Mutation run once (2026-12-04): putting the capture check back before ``resolve_ep_transport`` (on
the placeholder transport) fails every ``auto`` case that should start with graphs on
(``ValueError: MEGA_DISPATCH=auto is still waiting...``, now from plan/capture.py on the oracle's
pending answer; with that guard removed too, the GraphCaptureError of the issue: "EP over
MEGA_DISPATCH=nccl (ep_size 8)", back when pending was a placeholder nccl).
"""

from __future__ import annotations

import pytest
import torch

from megamoe_backend.experts.base import ExpertMath
from megamoe_backend.knobs import Knobs
from megamoe_backend.layer import ep_transport, startup
from megamoe_backend.plan import build_plan, select_for_device
from megamoe_backend.plan.capture import EngineGraphs, GraphCaptureError, require_capturable
from megamoe_backend.plan.forward_choice import ForwardFacts, choose_forward
from megamoe_backend.platform.select import PENDING_EP_GROUP
from megamoe_backend.platform import facts as platform_facts
from megamoe_backend.platform.facts import PackageInfo, PlatformFacts
from megamoe_backend.platform.topology import EpTopology, RankPlace
from megamoe_backend.spec import preset
from megamoe_backend.transport import clear_transport_cache

SPEC = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=128, n_routed_experts=16)
CUDA_TRITON = PlatformFacts(device="cuda", torch_build="cuda", torch_version="2.11.0+cu130", cuda_version="13.0",
                            gpu_count=8, packages={"triton": PackageInfo("triton", True, "3.6.0")})
VLLM, SGLANG = EngineGraphs(True, "--enforce-eager"), EngineGraphs(True, "--disable-cuda-graph")


def topology(ep: int, hosts: int = 1, peer_access: bool = True, gpus_per_rank: str = "own") -> EpTopology:
    gpus = [f"g{r}" if gpus_per_rank == "own" else "g0" for r in range(ep)]
    names = [f"h{r * hosts // ep}/boot" for r in range(ep)]
    every = tuple(dict.fromkeys(gpus))
    return EpTopology(tuple(RankPlace(names[r], gpus[r], every if peer_access else (gpus[r],), True) for r in range(ep)))


@pytest.fixture
def cuda_host(monkeypatch):
    """This CPU process plans and settles as a CUDA host with Triton does; returns the probe log."""
    clear_transport_cache()
    seen = {"probe": [], "topology": None, "probe_fails": False}
    monkeypatch.setattr(platform_facts, "device_kind", lambda device: "cuda")

    def probe(kind, group, device, timeout_s):
        seen["probe"].append(kind)
        return f"[megamoe] MEGA_DISPATCH={kind}: opening its peers' arenas failed on 1 of 8 rank(s) (ep_rank 3: boom)" \
            if seen["probe_fails"] else None

    monkeypatch.setattr(ep_transport, "gather_ep_topology", lambda group, device: seen["topology"])
    monkeypatch.setattr(ep_transport, "probe_peer_arenas", probe)
    yield seen
    clear_transport_cache()


def settle(seen, ep, knob="auto", graphs=VLLM, topo=None, rank=0):
    seen["topology"] = topo or topology(ep)
    knobs = Knobs(transport=knob)
    selection = select_for_device(knobs, ExpertMath("a8w4"), "cuda", ep_size=ep, num_experts=16, facts=CUDA_TRITON)
    plan = build_plan(SPEC, knobs, rank, ep, quant="a8w4", backends=selection)
    group = object() if ep > 1 else None
    return startup.settle_plan(plan, group, torch.device("cpu"), graphs)


# (ep, MEGA_DISPATCH, topology, graphs, expected transport or the refusal's flag)
STARTS = [
    (1, "auto", topology(1), VLLM, "nccl"),  # ep_size 1: the device forward, nothing exchanged
    (2, "auto", topology(2), VLLM, "symm"),
    (8, "auto", topology(8), VLLM, "symm"),  # the default start on an 8-GPU host
    (8, "auto", topology(8), SGLANG, "symm"),
    (8, "auto", topology(8, gpus_per_rank="shared"), VLLM, "ipc"),
    (8, "ipc", topology(8), VLLM, "ipc"),
    (8, "symm", topology(8), SGLANG, "symm"),
    (8, "auto", topology(8, hosts=2), EngineGraphs(False, "--enforce-eager"), "nccl"),  # eager: nccl serves
    (8, "nccl", topology(8), EngineGraphs(False, "--disable-cuda-graph"), "nccl"),
    (2, "auto", topology(2, peer_access=False), None, "nccl"),  # no engine (benchmarks): nothing refused
]
REFUSED = [
    (8, "auto", topology(8, hosts=2), VLLM, "--enforce-eager", "on 2 host(s)"),
    (8, "auto", topology(8, hosts=2), SGLANG, "--disable-cuda-graph", "on 2 host(s)"),
    (2, "auto", topology(2, peer_access=False), VLLM, "--enforce-eager", "cannot write ep_rank 1's GPU"),
    (8, "nccl", topology(8), VLLM, "--enforce-eager", "MEGA_DISPATCH=nccl)"),
    (2, "nccl", topology(2), SGLANG, "--disable-cuda-graph", "MEGA_DISPATCH=nccl)"),
]


@pytest.mark.parametrize("ep, knob, topo, graphs, transport", STARTS)
def test_what_starts(cuda_host, ep, knob, topo, graphs, transport):
    plan = settle(cuda_host, ep, knob, graphs, topo)
    assert plan.backends.transport == transport and not plan.backends.needs_ep_topology
    assert cuda_host["probe"] == ([transport] if knob == "auto" and transport in ("ipc", "symm") else [])


@pytest.mark.parametrize("ep, knob, topo, graphs, flag, why", REFUSED)
def test_what_is_refused_names_the_flag_and_why(cuda_host, ep, knob, topo, graphs, flag, why):
    with pytest.raises(GraphCaptureError) as err:
        settle(cuda_host, ep, knob, graphs, topo)
    text = str(err.value)
    assert f"Add {flag} to run eagerly" in text and why in text and "MEGA_DISPATCH=symm | ipc" in text


def test_a_failed_probe_falls_back_to_nccl_eager_and_refuses_a_capturing_engine(cuda_host):
    cuda_host["probe_fails"] = True
    eager = settle(cuda_host, 8, graphs=EngineGraphs(False, "--enforce-eager"))
    assert eager.backends.transport == "nccl"
    assert any("handshake over symm failed" in r and "ep_rank 3: boom" in r for r in eager.backends.reasons)
    clear_transport_cache()
    with pytest.raises(GraphCaptureError, match=r"handshake over symm failed.*ep_rank 3: boom.*Add --enforce-eager"):
        settle(cuda_host, 8)


def test_the_pending_answer_is_never_judged():
    selection = select_for_device(Knobs(), ExpertMath("a8w4"), "cuda", ep_size=8, num_experts=16, facts=CUDA_TRITON)
    plan = build_plan(SPEC, Knobs(), 0, 8, quant="a8w4", backends=selection)
    assert plan.backends.needs_ep_topology and plan.backends.transport == PENDING_EP_GROUP  # an answer, not nccl
    choice = choose_forward(ForwardFacts.of(plan, "cuda", engine_captures=True))
    assert choice.pending and choice.capturable is None and choice.takes_token_bound
    with pytest.raises(ValueError, match="settled plan"):
        require_capturable(choice, "--enforce-eager")


@pytest.mark.parametrize("graphs, said", [(VLLM, "graphs=captured"), (EngineGraphs(False, "--enforce-eager"), "graphs=eager"),
                                          (None, None)])
def test_the_startup_line_says_whether_the_engine_captures_the_layer(cuda_host, graphs, said):
    """What an operator greps to see the layer inside the engine's CUDA graphs (seen on an H100 in vLLM
    0.34: docs/vllm.md, "On a GPU"); no engine (benchmarks): no field."""
    line = settle(cuda_host, 8, graphs=graphs).startup_line()
    assert (said in line) if said else ("graphs=" not in line)
