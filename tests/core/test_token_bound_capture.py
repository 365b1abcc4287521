"""The two start-up/serving rules the engine plugins share (pure, facts injected, CPU):
the token bound (plan/token_bound.py) and "can this layer be captured" (plan/capture.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megamoe_backend.knobs import Knobs
from megamoe_backend.plan import build_plan
from megamoe_backend.plan.capture import CaptureFacts, GraphCaptureError, require_capturable, uncapturable_reason
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


def _layer(workspace, ep_size):
    return SimpleNamespace(workspace=workspace, plan=SimpleNamespace(ep_size=ep_size))


def test_the_forwards_that_exchange_rows_take_the_bound():
    from megamoe_backend.layer import MegaMoELayer
    from megamoe_backend.workload import ProblemConfig, make_problem

    problem = make_problem(ProblemConfig(SPEC, 2, 1, seed=0))
    cpu_layer = MegaMoELayer(build_plan(SPEC, Knobs()), problem.expert_weights("bf16"))
    assert cpu_layer.takes_token_bound and takes_token_bound(cpu_layer)  # the torch forward: checks it (its own test)
    # objects without a declared answer: a P2P workspace at ep_size > 1 (the only forward sized by it)
    assert takes_token_bound(_layer(object(), 2))
    assert not takes_token_bound(_layer(object(), 1))  # ep_size-1 device forward: no peers to agree with
    assert not takes_token_bound(_layer(None, 2))
    calls = []
    reader = lambda: calls.append(1) or 64  # noqa: E731
    assert bound_kwargs(_layer(object(), 4), reader) == {"max_tokens_across_ranks": 64}
    assert bound_kwargs(_layer(None, 4), reader) == {} and len(calls) == 1  # not even read where not taken
    assert bound_kwargs(cpu_layer, reader) == {"max_tokens_across_ranks": 64} and len(calls) == 2
    assert bound_kwargs(_layer(object(), 4), lambda: None) == {}  # no bound known: MTPR on every rank


CASES = [  # (device, provider, transport, ep_size, fused) -> capturable
    (("cuda", "triton", "ipc", 4, False), True),
    (("cuda", "triton", "symm", 8, False), True),
    (("cuda", "triton", "nccl", 1, False), True),  # ep_size 1: the device forward, no exchange
    (("cuda", "triton", "nccl", 2, False), False),
    (("cuda", "torch", "ipc", 2, False), False),
    (("cuda", "torch", "nccl", 1, False), False),
    (("rocm", "aiter", "mori", 8, True), True),  # aiter's fused runtime: sync-free (layer/forwards/fused.py)
    (("rocm", "triton", "mori", 2, False), True),  # the mori device forward (layer/forwards/mori.py)
    (("rocm", "torch", "mori", 2, False), False),
    (("cpu", "torch", "gloo", 2, False), True),  # nothing is captured on CPU
]


@pytest.mark.parametrize("facts, capturable", CASES, ids=["-".join(map(str, f)) for f, _ in CASES])
def test_capturability_follows_the_forward_the_layer_runs(facts, capturable):
    assert (uncapturable_reason(CaptureFacts(*facts)) is None) == capturable


def test_refusal_names_the_flag_only_when_the_engine_captures():
    nccl = CaptureFacts("cuda", "triton", "nccl", 2)
    with pytest.raises(GraphCaptureError, match=r"MEGA_DISPATCH=nccl \(ep_size 2\).*Add --enforce-eager"):
        require_capturable(nccl, True, "--enforce-eager")
    require_capturable(nccl, False, "--enforce-eager")  # eager engine: the torch forward serves
    require_capturable(CaptureFacts("cuda", "triton", "ipc", 2), True, "--enforce-eager")


def test_facts_are_read_from_a_real_plan():
    knobs = Knobs(transport="nccl")
    plan = build_plan(SPEC, knobs, 0, 2, device_type="cuda", quant="bf16", backends=("triton", "nccl"))
    assert CaptureFacts.of(plan, "cuda") == CaptureFacts("cuda", "triton", "nccl", 2, False)
    with pytest.raises(GraphCaptureError, match="--disable-cuda-graph"):
        require_capturable(CaptureFacts.of(plan, "cuda"), True, "--disable-cuda-graph")
    plan = build_plan(SPEC, knobs, 1, 2, device_type="cuda", quant="bf16", backends=("triton", "ipc"))
    assert uncapturable_reason(CaptureFacts.of(plan, "cuda")) is None
