"""The two start-up/serving rules the engine plugins share (pure, facts injected, CPU): the token
bound (plan/token_bound.py) and "can this layer be captured" (plan/capture.py), both read from the
forward oracle's answer (plan/forward_choice.py)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from megamoe_backend.knobs import Knobs
from megamoe_backend.plan import build_plan
from megamoe_backend.plan.capture import GraphCaptureError, require_capturable
from megamoe_backend.plan.forward_choice import ForwardFacts, choose_forward
from megamoe_backend.plan.token_bound import bound_kwargs, takes_token_bound, token_bound, tokens_per_ep_rank
from megamoe_backend.spec import preset

SPEC = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8)


@pytest.mark.parametrize("tokens, capacity, bound", [
    (0, 8192, 1), (1, 8192, 1), (2, 8192, 2), (3, 8192, 4), (8, 8192, 8), (9, 8192, 16), (4097, 8192, 8192),
    (8192, 8192, 8192), (5000, 6000, 6000), (100, 64, 64),
])
def test_bound_is_the_next_power_of_two_capped_at_the_capacity(tokens, capacity, bound):
    assert token_bound(tokens, capacity) == bound


def test_tokens_per_ep_rank_splits_each_dp_batch_over_tp():
    assert tokens_per_ep_rank([17, 1], 1) == 17
    assert tokens_per_ep_rank([17, 1], 2) == 9  # ceil(17 / 2): the largest TP slice of the largest batch
    assert tokens_per_ep_rank([], 4) == 0
    with pytest.raises(ValueError, match="split=0"):
        tokens_per_ep_rank([1], 0)


def _layer(device, transport, ep_size):
    """A stand-in runtime carrying only the oracle's answer for a Triton layer on ``device``."""
    return SimpleNamespace(forward_choice=choose_forward(ForwardFacts(device, "triton", transport, ep_size)))


def test_the_forwards_that_exchange_rows_take_the_bound():
    from megamoe_backend.layer import MegaMoELayer
    from megamoe_backend.workload import ProblemConfig, make_problem

    problem = make_problem(ProblemConfig(SPEC, 2, 1, seed=0))
    cpu_layer = MegaMoELayer(build_plan(SPEC, Knobs()), problem.expert_weights("bf16"))
    assert cpu_layer.takes_token_bound and takes_token_bound(cpu_layer)  # the torch forward: checks it (its own test)
    assert cpu_layer.forward_choice.forward == "torch"
    assert takes_token_bound(_layer("cuda", "symm", 2))  # the device P2P forward: sized by it
    assert not takes_token_bound(_layer("cuda", "nccl", 1))  # ep_size-1 device forward: no peers to agree with
    assert not takes_token_bound(SimpleNamespace(workspace=object()))  # no forward choice: a stand-in takes none
    calls = []
    reader = lambda: calls.append(1) or 64  # noqa: E731
    assert bound_kwargs(_layer("cuda", "ipc", 4), reader) == {"max_tokens_across_ranks": 64}
    assert bound_kwargs(_layer("cuda", "nccl", 1), reader) == {} and len(calls) == 1  # not even read where not taken
    assert bound_kwargs(cpu_layer, reader) == {"max_tokens_across_ranks": 64} and len(calls) == 2
    assert bound_kwargs(_layer("cuda", "ipc", 4), lambda: None) == {}  # no bound known: MTPR on every rank


CASES = [  # (device, provider, transport, ep_size, fused) -> capturable
    (("cuda", "triton", "ipc", 4, False), True),
    (("cuda", "triton", "symm", 8, False), True),
    (("cuda", "triton", "nccl", 1, False), True),  # ep_size 1: the device forward, no exchange
    (("cuda", "triton", "nccl", 2, False), False),
    (("cuda", "torch", "nccl", 1, False), False),
    (("rocm", "aiter", "mori", 8, True), True),  # aiter's fused runtime: sync-free (layer/forwards/fused.py)
    (("rocm", "triton", "mori", 2, False), True),  # the mori device forward (layer/forwards/mori.py)
    (("rocm", "torch", "mori", 2, False), False),
    (("cpu", "torch", "gloo", 2, False), True),  # nothing is captured on CPU
]


@pytest.mark.parametrize("facts, capturable", CASES, ids=["-".join(map(str, f)) for f, _ in CASES])
def test_capturability_follows_the_forward_the_layer_runs(facts, capturable):
    assert choose_forward(ForwardFacts(*facts)).capturable == capturable


def test_the_torch_experts_over_peer_arenas_are_refused_naming_the_fix():
    """symm / ipc are the device P2P forward: the torch forward never runs over them (once refused when
    the torch forward built its transport, transport/registry.py; now by the oracle, before anything)."""
    with pytest.raises(ValueError, match=r"MEGA_DISPATCH=ipc is the device P2P forward.*experts torch.*MEGA_DISPATCH=nccl"):
        choose_forward(ForwardFacts("cuda", "torch", "ipc", 2))


def test_refusal_names_the_flag_only_when_the_engine_captures():
    nccl = ForwardFacts("cuda", "triton", "nccl", 2)
    with pytest.raises(GraphCaptureError, match=r"MEGA_DISPATCH=nccl \(ep_size 2\).*Add --enforce-eager"):
        require_capturable(choose_forward(replace(nccl, engine_captures=True)), "--enforce-eager")
    require_capturable(choose_forward(replace(nccl, engine_captures=False)), "--enforce-eager")  # eager: torch serves
    require_capturable(choose_forward(ForwardFacts("cuda", "triton", "ipc", 2, engine_captures=True)), "--enforce-eager")


def test_facts_are_read_from_a_real_plan():
    knobs = Knobs(transport="nccl")
    plan = build_plan(SPEC, knobs, 0, 2, device_type="cuda", quant="bf16", backends=("triton", "nccl"))
    assert ForwardFacts.of(plan, "cuda") == ForwardFacts("cuda", "triton", "nccl", 2, False, scheme="bf16")
    with pytest.raises(GraphCaptureError, match="--disable-cuda-graph"):
        require_capturable(choose_forward(ForwardFacts.of(plan, "cuda", engine_captures=True)), "--disable-cuda-graph")
    plan = build_plan(SPEC, knobs, 1, 2, device_type="cuda", quant="bf16", backends=("triton", "ipc"))
    assert choose_forward(ForwardFacts.of(plan, "cuda")).capturable
