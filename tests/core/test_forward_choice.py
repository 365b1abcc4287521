"""The forward oracle (plan/forward_choice.py): facts in, one ForwardChoice out, and every reader of it.

The table is written out by hand per case (not recomputed): which forward, whether a capture can hold
it, whether it takes the engine's token bound. Then the readers: the layer builds the forward the
choice names and answers ``takes_token_bound`` from it, the token-bound helper the plugins call reads
it, and ``megamoe info`` prints it and the startup line the layer would log.
"""

from __future__ import annotations

import json

import pytest

from megamoe_backend.knobs import Knobs
from megamoe_backend.plan import build_plan
from megamoe_backend.plan.forward_choice import ForwardFacts, choose_forward
from megamoe_backend.plan.token_bound import takes_token_bound
from megamoe_backend.platform.select import PENDING_EP_GROUP
from megamoe_backend.spec import preset

SPEC = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8)

# (device, provider, transport, ep_size, fused) -> (forward, capturable, takes the token bound, moves_rows)
TABLE = [
    (("cuda", "triton", "nccl", 1, False), ("device", True, False, "device")),
    (("cuda", "triton", "symm", 8, False), ("p2p", True, True, "device p2p over symm")),
    (("cuda", "triton", "ipc", 2, False), ("p2p", True, True, "device p2p over ipc")),
    (("cuda", "triton", "nccl", 8, False), ("torch", False, True, "nccl")),
    (("cuda", "torch", "nccl", 1, False), ("torch", False, True, "nccl")),
    (("cuda", "triton", PENDING_EP_GROUP, 8, False), ("pending", None, True, PENDING_EP_GROUP)),
    (("rocm", "aiter", "mori", 8, True), ("fused", True, True, "fused")),  # aiter's config_tokens: takes the bound
    (("rocm", "triton", "mori", 8, False), ("mori", True, True, "device mori")),
    (("rocm", "torch", "mori", 2, False), ("torch", False, True, "mori")),
    (("rocm", "triton", "nccl", 1, False), ("device", True, False, "device")),
    (("cpu", "torch", "gloo", 2, False), ("torch", True, True, "gloo")),  # nothing is captured on CPU
    (("cpu", "torch", "gloo", 1, False), ("torch", True, True, "gloo")),
]


@pytest.mark.parametrize("facts, answer", TABLE, ids=["-".join(map(str, f)) for f, _ in TABLE])
def test_the_oracle_answers_each_platform(facts, answer):
    c = choose_forward(ForwardFacts(*facts))
    assert (c.forward, c.capturable, c.takes_token_bound, c.moves_rows) == answer
    assert c.why


def test_the_callers_overrides_are_facts_too():
    symm = ForwardFacts("cpu", "triton", "symm", 2, device_forward=True)  # the Triton interpreter on CPU
    assert choose_forward(symm).forward == "p2p"
    given = ForwardFacts("cuda", "triton", "nccl", 1, transport_given=True)  # a Transport handed to the layer
    assert choose_forward(given).forward == "torch"
    mori = ForwardFacts("rocm", "triton", "mori", 2, device_forward=True, transport_given=True)  # mori's, for tests
    assert choose_forward(mori).forward == "mori"
    with pytest.raises(ValueError, match=r"device forward runs at ep_size 1 or over MEGA_DISPATCH=symm \| ipc"):
        choose_forward(ForwardFacts("cuda", "triton", "nccl", 2, device_forward=True))


def test_engine_graphs_follow_the_engine_and_the_device():
    ipc = ForwardFacts("cuda", "triton", "ipc", 2)
    assert choose_forward(ipc).engine_graphs is None  # no engine said
    assert choose_forward(ForwardFacts("cuda", "triton", "ipc", 2, engine_captures=True)).engine_graphs == "captured"
    assert choose_forward(ForwardFacts("cpu", "torch", "gloo", 2, engine_captures=True)).engine_graphs == "eager"
    nccl = choose_forward(ForwardFacts("cuda", "triton", "nccl", 2, engine_captures=True))
    assert nccl.refused_by_engine and not choose_forward(ForwardFacts("cuda", "triton", "nccl", 2)).refused_by_engine


def test_the_layer_builds_and_answers_what_the_oracle_chose():
    from megamoe_backend.layer import MegaMoELayer
    from megamoe_backend.workload import ProblemConfig, make_problem

    problem = make_problem(ProblemConfig(SPEC, 2, 1, seed=0))
    layer = MegaMoELayer(build_plan(SPEC, Knobs()), problem.expert_weights("bf16"))
    assert layer.forward_choice == choose_forward(ForwardFacts("cpu", "torch", "gloo", 1, scheme=layer.plan.math.quant))
    assert type(layer.path).__name__ == "TorchForward"
    assert layer.takes_token_bound is layer.forward_choice.takes_token_bound is takes_token_bound(layer) is True


def test_a_layer_left_pending_says_what_it_needs():
    from megamoe_backend.experts.base import ExpertMath
    from megamoe_backend.experts.weights import quantize_expert_weights
    from megamoe_backend.layer import MegaMoELayer
    from megamoe_backend.plan import select_for_device
    from megamoe_backend.platform.facts import PackageInfo, PlatformFacts
    from megamoe_backend.workload import ProblemConfig, make_problem
    from megamoe_backend.workload.problem import WEIGHT_FMT_FOR_QUANT

    cuda = PlatformFacts(device="cuda", torch_build="cuda", torch_version="2.11.0+cu130", cuda_version="13.0",
                         gpu_count=8, packages={"triton": PackageInfo("triton", True, "3.6.0")})
    selection = select_for_device(Knobs(), ExpertMath("bf16"), "cuda", ep_size=2, num_experts=8, facts=cuda)
    plan = build_plan(SPEC, Knobs(), 0, 2, quant="bf16", backends=selection)
    problem = make_problem(ProblemConfig(SPEC, 2, 2, seed=0))
    local = quantize_expert_weights(problem.w1[:4], problem.w2[:4], WEIGHT_FMT_FOR_QUANT["bf16"])  # ep_rank 0's
    with pytest.raises(ValueError, match=r"MEGA_DISPATCH=auto waits for the EP group's topology.*pass the EP process group"):
        MegaMoELayer(plan, local, device="cpu")


def _info(capsys, *args):
    from megamoe_backend.cli.main import main

    rc = main(["info", *args])
    return rc, capsys.readouterr().out


def test_info_prints_the_oracles_answer_and_the_line_the_layer_logs(capsys, monkeypatch):
    for knob in ("MEGA_DISPATCH", "MEGA_DISPATCH_WIRE", "MEGA_COMBINE_WIRE", "MEGA_MAX_TOKENS_PER_RANK"):
        monkeypatch.delenv(knob, raising=False)
    rc, out = _info(capsys, "--preset", "dsv4-pro", "--device", "cuda", "--ep-size", "1", "--json")
    got = json.loads(out)
    assert rc == 0 and got["forward"]["forward"] == "device" and not got["forward"]["takes_token_bound"]
    assert " transport=device " in got["startup_line"]  # as the device forward logs it, not the selection's nccl
    rc, out = _info(capsys, "--preset", "dsv4-pro", "--device", "cuda", "--json")
    got = json.loads(out)
    assert got["forward"]["forward"] == "pending" and got["forward"]["capturable"] is None
    assert " transport=device p2p over symm " in got["startup_line"]  # auto's pick on one host, as the layer logs it
    rc, out = _info(capsys, "--preset", "dsv4-pro", "--device", "cuda")
    assert rc == 0 and "pending (capture judged" in out  # the table's forward row (rich wraps the rest)
