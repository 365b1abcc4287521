"""MEGA_EXPERTS_GEMM: read once by Knobs, handed to the Triton provider by the registry (nothing else
reads the environment), and ``cuda`` (the sm_90a CUDA GEMMs, now research code) refused by name."""

from __future__ import annotations

import pytest

from megamoe_backend.experts.registry import describe_experts_gemm, make_provider
from megamoe_backend.knobs import KnobError, Knobs
from megamoe_backend.layer import MegaMoELayer
from megamoe_backend.plan import build_plan
from megamoe_backend.spec import preset
from megamoe_backend.workload import ProblemConfig, make_problem

SPEC = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8)


def triton_experts():
    """TritonExperts, or a skip where triton is not installed (the knob tests here need no triton)."""
    pytest.importorskip("triton", reason="TritonExperts imports triton (pip install -e .[test,triton])")
    from megamoe_backend.experts.triton import TritonExperts

    return TritonExperts


def test_knob_values():
    assert Knobs.from_env({}).experts_gemm == "auto"
    assert Knobs.from_env({"MEGA_EXPERTS_GEMM": "Triton"}).experts_gemm == "triton"
    with pytest.raises(KnobError, match=r"MEGA_EXPERTS_GEMM=.cutlass. is not valid; allowed values: auto \| triton \| humming"):
        Knobs.from_env({"MEGA_EXPERTS_GEMM": "cutlass"})


@pytest.mark.parametrize("build", [
    lambda: Knobs.from_env({"MEGA_EXPERTS_GEMM": "CUDA"}),
    lambda: Knobs(experts_gemm="cuda"),
    lambda: triton_experts()(gemm="cuda"),
], ids=["env", "knobs", "provider"])
def test_cuda_is_refused_naming_the_knob_and_where_the_code_went(build):
    with pytest.raises(KnobError, match=r"MEGA_EXPERTS_GEMM=cuda: .* benchmarks/research/cuda_gemms/\. Unset MEGA_EXPERTS_GEMM"):
        build()


def test_info_line_names_what_runs():
    assert describe_experts_gemm("auto", "triton").startswith("Triton (MEGA_EXPERTS_GEMM=auto")
    assert describe_experts_gemm("triton", "torch").startswith("torch provider")


def test_the_layer_hands_its_plans_knob_to_the_provider(monkeypatch):
    """The environment set after import reaches the provider through Knobs.from_env -> the plan -> the
    registry (the provider itself never reads os.environ: a value it read would be ignored here)."""
    TritonExperts = triton_experts()
    monkeypatch.setenv("MEGA_EXPERTS_GEMM", "triton")
    knobs = Knobs.from_env()
    assert make_provider("triton", 8, knobs).gemm == "triton"
    monkeypatch.setenv("MEGA_EXPERTS_GEMM", "auto")  # the provider must not look again
    p = make_problem(ProblemConfig(SPEC, 4, 1, seed=1))
    plan = build_plan(SPEC, knobs, quant="a8w4", backends=("triton", "local"))
    layer = MegaMoELayer(plan, p.expert_weights("a8w4"), device="cpu", device_path=False)
    assert isinstance(layer.provider, TritonExperts) and layer.provider.gemm == "triton"
    assert make_provider("triton", 8).gemm == "auto"  # no knobs: the defaults, not the environment
