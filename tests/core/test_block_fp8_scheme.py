"""Block-FP8 experts (quant fp8_block) as a scheme: its A format, the dispatch wire rule, start-up refusals.

MEGA_DISPATCH_WIRE=fp8 means the GEMM's own A format: for fp8_block that is e4m3 rows with one fp32 scale per
1x128 group (the same 7168 + 224 bytes a row as MXFP8 at hidden 7168), never MX rows; bf16 is always legal,
fp4 is refused naming the knob. A checkpoint with per-tensor FP8 scales or another block size is refused
naming ``weight_block_size``; the engines still refuse block-FP8 checkpoints (they do not read them yet).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megamoe_backend.experts import ExpertMath, TorchReferenceExperts
from megamoe_backend.experts.base import ExpertPairs
from megamoe_backend.formats import dispatch_wire, quantize_mx
from megamoe_backend.formats.block_fp8 import GroupFP8Tensor
from megamoe_backend.knobs import KnobError, Knobs
from megamoe_backend.plan import build_plan
from megamoe_backend.platform import PlatformError
from megamoe_backend.spec import ConfigError, UnsupportedExpertsError, expert_quant_scheme, preset, quant_scheme_from_config
from block_fp8_twin import np_group_quant


def test_a_format_and_the_fp8_wire_carry_1x128_groups() -> None:
    assert ExpertMath("fp8_block").a_format == "fp8_g128"
    plan = build_plan(preset("dsv4-pro"), Knobs(dispatch_wire="fp8"), quant="fp8_block")
    assert plan.dispatch.mx == "fp8_g128" and plan.dispatch.row_bytes(7168) == 7168 + 56 * 4
    assert build_plan(preset("dsv4-pro"), Knobs(dispatch_wire="fp8"), quant="a8w4").dispatch.mx == "fp8"  # unchanged
    assert build_plan(preset("dsv4-pro"), Knobs(), quant="fp8_block").dispatch.mx is None  # bf16 wire: legal


def test_wire_rows_are_vllms_group_quantisation_bit_for_bit() -> None:
    x = (torch.randn(5, 384) * torch.logspace(-2, 2, 384)).to(torch.bfloat16)
    wire = dispatch_wire("fp8", "fp8_g128")
    rows = wire.encode(x)
    q, s = np_group_quant(x.float().numpy())
    assert np.array_equal(rows[:, :384].numpy(), q)
    assert np.array_equal(rows[:, 384:].contiguous().view(torch.float32).numpy(), s)
    back = wire.decode(rows, 384)
    assert isinstance(back, GroupFP8Tensor) and torch.equal(back.data, rows[:, :384])
    # planted: the wire ignoring the A format (MX rows) -- same byte count, other bytes
    mx = dispatch_wire("fp8").encode(x)
    assert mx.shape == rows.shape and not torch.equal(mx, rows)


def test_experts_refuse_rows_in_another_a_format() -> None:
    """A planted MX fp8 wire in front of block-FP8 experts is refused, not re-read as 1x128 groups."""
    from megamoe_backend.workload import ProblemConfig, make_problem

    spec = preset("dsv4-pro").scaled(hidden_size=256, moe_intermediate_size=128, n_routed_experts=8)
    p = make_problem(ProblemConfig(spec, 4, 1, seed=0))
    pairs = ExpertPairs(torch.arange(4), torch.arange(4), torch.ones(4))
    with pytest.raises(ValueError, match="MEGA_DISPATCH_WIRE must match"):
        TorchReferenceExperts().forward(quantize_mx(p.x.float(), "fp8"), pairs, p.expert_weights("fp8_block"),
                                        ExpertMath("fp8_block"))


def test_fp4_wire_is_refused_naming_the_knob() -> None:
    with pytest.raises(KnobError, match=r"MEGA_DISPATCH_WIRE=fp4 .*1x128 groups.*bf16 or fp8"):
        build_plan(preset("dsv4-pro"), Knobs(dispatch_wire="fp4"), quant="fp8_block")


def test_sizes_not_in_128_blocks_are_refused() -> None:
    spec = preset("dsv4-pro").scaled(hidden_size=256, moe_intermediate_size=96)
    with pytest.raises(ValueError, match="moe_intermediate_size % 128"):
        build_plan(spec, Knobs(), quant="fp8_block")
    spec = preset("dsv4-pro").scaled(hidden_size=288, moe_intermediate_size=128)
    with pytest.raises(ValueError, match="MEGA_DISPATCH_WIRE=fp8 for block-FP8 experts needs hidden % 128"):
        build_plan(spec, Knobs(dispatch_wire="fp8"), quant="fp8_block")


def test_gpu_plans_name_the_triton_experts_or_refuse() -> None:
    """CUDA with Triton: the Triton experts (block_fp8 decoder) over the transports the MXFP4 Triton experts take:
    MEGA_DISPATCH=auto is the device P2P forward (symm / ipc) on one host with peer access, pending until the EP
    group's topology is known, NCCL across hosts; symm / ipc / nccl as asked. mori / flydsl (ROCm transports),
    CUDA without Triton and ROCm refused at plan time."""
    import dataclasses

    from megamoe_backend.platform.facts import PackageInfo, PlatformFacts
    from megamoe_backend.platform.select import PENDING_EP_GROUP
    from megamoe_backend.platform.topology import EpTopology, RankPlace

    cuda = PlatformFacts(device="cuda", torch_build="cuda", packages={"triton": PackageInfo("triton", True)})
    plan_for = lambda knobs, ep, facts=cuda: build_plan(preset("dsv4-pro"), knobs, quant="fp8_block",  # noqa: E731
                                                         ep_size=ep, facts=facts, device_type="cuda").backends
    assert (plan_for(Knobs(), 1).provider, plan_for(Knobs(), 1).transport) == ("triton", "nccl")
    assert plan_for(Knobs(), 8).transport == PENDING_EP_GROUP
    gpus = [f"gpu{r}" for r in range(8)]
    one_host = EpTopology(tuple(RankPlace("h", g, tuple(gpus), symm_mem=True) for g in gpus))
    two_hosts = EpTopology(tuple(RankPlace(f"h{r // 4}", g, tuple(gpus[r // 4 * 4:][:4])) for r, g in enumerate(gpus)))
    assert plan_for(Knobs(), 8, dataclasses.replace(cuda, ep_topology=one_host)).transport == "symm"
    assert plan_for(Knobs(), 8, dataclasses.replace(cuda, ep_topology=two_hosts)).transport == "nccl"
    for transport in ("symm", "ipc", "nccl"):
        assert plan_for(Knobs(transport=transport), 8).transport == transport
    for transport in ("mori", "flydsl"):
        with pytest.raises(PlatformError, match=f"MEGA_DISPATCH={transport}"):
            plan_for(Knobs(transport=transport), 8)
    with pytest.raises(PlatformError, match="triton is not importable"):
        build_plan(preset("dsv4-pro"), Knobs(), quant="fp8_block", facts=PlatformFacts(device="cuda", torch_build="cuda"),
                   device_type="cuda")
    with pytest.raises(PlatformError, match="no rocm experts provider"):
        build_plan(preset("dsv4-pro"), Knobs(), quant="fp8_block", facts=PlatformFacts(device="rocm", torch_build="rocm"),
                   device_type="cuda")


@pytest.mark.parametrize("cfg, match", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor FP8 scales"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 64]}, r"weight_block_size \[128, 64\]"),
])
def test_checkpoint_block_size_refusals_name_weight_block_size(cfg, match) -> None:
    with pytest.raises(ConfigError, match=match):
        quant_scheme_from_config(cfg, None, "deepseek_v3")
    assert quant_scheme_from_config({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, "deepseek_v3") == "fp8_block"
    # V4's fp8 config with fp4 experts: weight_block_size is the linears', not the experts' business
    assert quant_scheme_from_config({"quant_method": "fp8"}, None, "deepseek_v4") == "a4w4"


@pytest.mark.parametrize("force", [None, False, True])
def test_block_fp8_runs_as_declared_whatever_aiter_force_a8w4(force) -> None:
    """The engines serve block-FP8 checkpoints as declared: AITER_FORCE_A8W4 is about MXFP4 weights."""
    assert expert_quant_scheme("fp8_block", force, "--moe-backend megamoe_ep") == "fp8_block"


def test_info_plans_the_r1_fp8_preset_on_cpu_and_cuda(capsys, monkeypatch) -> None:
    """`megamoe info --preset r1-fp8`: the block-FP8 scheme, its weights' bytes (e4m3 + one fp32 per 128 x 128
    block, not MXFP4's half byte); on CUDA the Triton experts, over the device P2P forward with MEGA_DISPATCH=ipc,
    and a ROCm transport refused naming the knob."""
    import json

    from megamoe_backend.cli.main import main
    from megamoe_backend.layer.memory import expert_weight_bytes

    per_expert = 3 * 7168 * 2048
    assert expert_weight_bytes(7168, 2048, "fp8_block") == per_expert + 4 * per_expert // (128 * 128)
    assert main(["info", "--preset", "r1-fp8", "--device", "cpu", "--ep-size", "8", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["spec"]["quant"] == "fp8_block" and "quant=fp8_block " in info["startup_line"]
    assert info["memory_per_gpu"]["weights"] == 58 * 32 * expert_weight_bytes(7168, 2048, "fp8_block")
    assert main(["info", "--preset", "r1-fp8", "--device", "cuda", "--json"]) == 0
    assert "quant=fp8_block experts_provider=triton" in json.loads(capsys.readouterr().out)["startup_line"]
    monkeypatch.setenv("MEGA_DISPATCH", "ipc")
    assert main(["info", "--preset", "r1-fp8", "--device", "cuda", "--ep-size", "8", "--json"]) == 0
    assert "transport=device p2p over ipc" in json.loads(capsys.readouterr().out)["startup_line"]
    monkeypatch.setenv("MEGA_DISPATCH", "mori")
    assert main(["info", "--preset", "r1-fp8", "--device", "cuda", "--ep-size", "8"]) == 2
    assert "MEGA_DISPATCH=mori" in capsys.readouterr().out
