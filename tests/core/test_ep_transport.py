"""MEGA_DISPATCH=auto on CUDA: the transport table from injected EP topologies, and its completion by
the layer with the EP group (layer/ep_transport.py) — all on CPU, the facts built by hand.

The table: the capturable device P2P forward (ipc / symm) when the Triton experts run and every EP
rank can write every other rank's arena (one host, CUDA peer access); symm where torch offers
symmetric memory and no two ranks share a GPU; nccl otherwise (several hosts, no peer access, a
GPU hidden by CUDA_VISIBLE_DEVICES, no Triton) and when the peer-arena handshake fails.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from megamoe_backend.experts.base import ExpertMath
from megamoe_backend.knobs import Knobs
from megamoe_backend.layer.ep_transport import EpTransportChoice, decide_ep_transport, resolve_ep_transport
from megamoe_backend.plan import build_plan, select_for_device
from megamoe_backend.platform import select_backends as select_for_facts
from megamoe_backend.platform.select import PENDING_EP_GROUP
from megamoe_backend.platform.facts import PackageInfo, PlatformFacts
from megamoe_backend.platform.topology import EpTopology, RankPlace, local_place
from megamoe_backend.spec import preset
from megamoe_backend.transport import clear_transport_cache

A8W4 = ExpertMath("a8w4")
SPEC = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8)


def facts(triton=True, topology=None) -> PlatformFacts:
    return PlatformFacts(device="cuda", torch_build="cuda", torch_version="2.11.0+cu130", cuda_version="13.0", gpu_count=8,
                         packages={"triton": PackageInfo("triton", triton, "3.6.0")}, ep_topology=topology)


def ranks(gpus, hosts=None, symm=True, reach=None) -> EpTopology:
    """One place per rank: ``gpus[r]`` its GPU; every rank reaches every GPU listed unless ``reach`` says."""
    hosts = hosts or ["h/boot"] * len(gpus)
    every = tuple(dict.fromkeys(gpus))
    return EpTopology(tuple(RankPlace(h, g, tuple(reach[r]) if reach else every, symm) for r, (g, h) in enumerate(zip(gpus, hosts))))


def auto(topology, ep=4, triton=True):
    return select_for_facts(facts(triton, topology), Knobs(), A8W4, ep_size=ep, num_experts=24)


@pytest.mark.parametrize("topology, ep, triton, transport, why", [
    (ranks(["g0", "g0", "g0", "g0"]), 4, True, "ipc", "ranks share a GPU"),
    (ranks(["g0", "g1", "g2", "g3"]), 4, True, "symm", "every rank its own GPU, peer access: torch symmetric memory"),
    (ranks(["g0", "g1", "g2", "g3"], symm=False), 4, True, "ipc", "this torch has no symmetric memory"),
    (ranks(["g0", "g1", "g0", "g1"]), 4, True, "ipc", "ranks share a GPU"),
    (ranks(["g0", "g1", "g0", "g1"], hosts=["a/1", "a/1", "b/2", "b/2"]), 4, True, "nccl", "on 2 host(s), 2 GPU(s) (a, b)"),
    (ranks(["g0", "g1"], hosts=["a/1", "a/2"]), 2, True, "nccl", "needs every EP rank on one host"),  # same name, two boots
    (ranks(["g0", "g1"], reach=[["g0"], ["g1", "g0"]]), 2, True, "nccl", "ep_rank 0 cannot write ep_rank 1's GPU"),
    (ranks(["g0", "g1"]), 2, False, "nccl", "needs the Triton experts"),
    (ranks(["g0", "g1"]), 1, True, "nccl", "ep_size 1: nothing is exchanged"),
])
def test_auto_on_cuda_picks_what_serves(topology, ep, triton, transport, why):
    sel = auto(topology, ep, triton)
    assert sel.transport == transport and not sel.needs_ep_topology
    assert any(r.startswith(f"transport {transport} (MEGA_DISPATCH=auto): ") and why in r for r in sel.reasons), sel.reasons


def test_without_the_topology_auto_waits_for_the_group_and_explicit_choices_do_not():
    sel = auto(None, ep=8)
    assert (sel.transport, sel.needs_ep_topology) == (PENDING_EP_GROUP, True)
    assert any("decided at start-up over the EP group" in r for r in sel.reasons)
    shared = ranks(["g0", "g0"])
    for knob in ("ipc", "symm", "nccl"):  # the operator's choice is never second-guessed
        explicit = select_for_facts(facts(topology=shared), Knobs(transport=knob), A8W4, ep_size=2, num_experts=8)
        assert (explicit.transport, explicit.needs_ep_topology) == (knob, False)
    # the plan's selection takes the topology too (plan/selection.py), over this machine's facts
    assert select_for_device(Knobs(), A8W4, "cuda", ep_size=2, facts=facts(), topology=shared).transport == "ipc"


def test_missing_peer_access_and_hidden_gpus_name_the_ranks():
    hidden = ranks(["g0", "g1", "g2"], reach=[["g0"], ["g0", "g1", "g2"], ["g0", "g1", "g2"]])  # rank 0 sees only g0
    assert hidden.missing_peer_access() == [(0, 1), (0, 2)]
    sel = auto(hidden, ep=3)
    assert sel.transport == "nccl" and any("ep_rank 0 cannot write ep_rank 1's GPU" in r and "2 such pair(s)" in r
                                           for r in sel.reasons)


class _FakeCuda:
    """torch.cuda as local_place sees it: 3 GPUs, 0 <-> 1 peer access, 2 isolated."""

    def __init__(self):
        self.peers = {(0, 1), (1, 0)}

    def current_device(self):
        return 1

    def device_count(self):
        return 3

    def can_device_access_peer(self, a, b):
        return (a, b) in self.peers

    def get_device_properties(self, i):
        return SimpleNamespace(uuid=f"GPU-{i}")


def test_local_place_reads_uuid_and_peer_access():
    fake = SimpleNamespace(cuda=_FakeCuda())
    place = local_place(torch.device("cuda"), torch_module=fake)  # no index: the current device (1)
    assert (place.gpu, place.reachable) == ("GPU-1", ("GPU-0", "GPU-1"))
    assert local_place(torch.device("cuda", 2), torch_module=fake).reachable == ("GPU-2",)
    cpu = local_place(torch.device("cpu"))
    assert cpu.gpu == "" and "/" in cpu.host  # host name / boot id


# ---- the layer's completion (layer/ep_transport.py), with the group's collectives injected -------------

@pytest.fixture
def fresh():
    clear_transport_cache()
    yield
    clear_transport_cache()


def pending_plan(rank=0, knobs=None):
    """A plan as build_plan makes it on a CUDA machine with triton (the facts injected: this one may lack both)."""
    knobs = knobs or Knobs()
    selection = select_for_device(knobs, A8W4, "cuda", ep_size=2, num_experts=8, facts=facts())
    return build_plan(SPEC, knobs, rank, 2, quant="a8w4", backends=selection)


def test_the_layer_completes_auto_once_per_group_after_a_handshake(fresh, caplog):
    calls = {"gather": 0, "probe": []}

    def gather(group, device):
        calls["gather"] += 1
        return ranks(["g0", "g0"])

    def probe(kind, group, device, timeout_s):
        calls["probe"].append((kind, timeout_s))
        return None

    group, device = object(), torch.device("cuda", 0)
    decide = lambda plan, g, d: decide_ep_transport(plan, g, d, gather=gather, probe=probe)  # noqa: E731
    plan = pending_plan()
    assert plan.backends.needs_ep_topology and plan.backends.transport == PENDING_EP_GROUP
    with caplog.at_level(logging.INFO, logger="megamoe"):
        logging.getLogger("megamoe").addHandler(caplog.handler)
        try:
            first = resolve_ep_transport(plan, group, device, decide=decide)
            again = resolve_ep_transport(pending_plan(knobs=Knobs(dispatch_wire="fp8")), group, device, decide=decide)
        finally:
            logging.getLogger("megamoe").removeHandler(caplog.handler)
    assert (first.backends.transport, again.backends.transport) == ("ipc", "ipc")
    assert not first.backends.needs_ep_topology and again.dispatch.name == "fp8"  # the rest of each plan is kept
    assert calls == {"gather": 1, "probe": [("ipc", plan.knobs.p2p_timeout_s)]}  # decided once for the group
    assert first.layout_key()[0] == "ipc"  # the workspace cache keys on the resolved transport
    assert any("transport ipc (MEGA_DISPATCH=auto)" in r and "handshake passed" in r for r in first.backends.reasons)
    lines = [r.getMessage() for r in caplog.records if "MEGA_DISPATCH=auto" in r.getMessage()]
    assert len(lines) == 1 and "ep_rank 0: transport ipc" in lines[0] and "ranks share a GPU" in lines[0]


def test_a_failed_handshake_means_nccl_never_a_failed_start(fresh):
    failure = "[megamoe] MEGA_DISPATCH=symm: peer-arena handshake failed, ep_rank(s) [1] did not answer"
    choice = decide_ep_transport(pending_plan(), object(), torch.device("cuda", 0),
                                 gather=lambda g, d: ranks(["g0", "g1"]), probe=lambda *a: failure)
    assert choice.transport == "nccl"
    assert "peer-arena handshake over symm failed, so nccl (eager)" in choice.why and "ep_rank(s) [1]" in choice.why
    # several hosts: no handshake is tried at all
    tried = []
    choice = decide_ep_transport(pending_plan(), object(), torch.device("cuda", 0),
                                 gather=lambda g, d: ranks(["g0", "g1"], hosts=["a/1", "b/1"]),
                                 probe=lambda *a: tried.append(a))
    assert choice.transport == "nccl" and tried == []


def test_plans_that_chose_already_pass_through(fresh):
    def never(*args):
        raise AssertionError("no collective for a plan that needs no topology")

    explicit = pending_plan(knobs=Knobs(transport="ipc"))
    assert resolve_ep_transport(explicit, object(), torch.device("cuda", 0), decide=never) is explicit
    pending = pending_plan()
    assert resolve_ep_transport(pending, None, torch.device("cuda", 0), decide=never) is pending  # ep_size 1: no group
    assert resolve_ep_transport(pending, object(), torch.device("cpu"), decide=never) is pending
    assert resolve_ep_transport(pending, object(), torch.device("cuda", 0),
                                decide=lambda *a: EpTransportChoice("nccl", "test")).backends.transport == "nccl"
