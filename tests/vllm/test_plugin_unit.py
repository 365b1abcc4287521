"""Plugin pieces without an engine: backend-name registration, CLI parsing, weight mapping, placement."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import megamoe_vllm
from megamoe_backend.experts import deinterleave_gate_up
from megamoe_backend.formats import dequantize_mx, quantize_mx
from megamoe_backend.knobs import Knobs
from megamoe_backend.plan import PlacementError
from megamoe_vllm.method import MegaMoEConfigError, check_deployment, vllm_placement
from megamoe_vllm.mxfp4_params import MXFP4ExpertParams
from megamoe_vllm.weights import ExpertFormat, UnsupportedExpertsError, expert_format_of, expert_weights_from_params


@pytest.fixture(scope="module", autouse=True)
def registered():
    megamoe_vllm.register()
    megamoe_vllm.register()  # idempotent: vLLM may call it more than once per process


@pytest.mark.parametrize("version,action", [
    ("0.32.0", "register"), ("0.33.1+cpu", "register"), ("0.34.0", "register"), ("0.34.7", "register"),
    ("0.35.0", "try"), ("0.35.0rc1", "try"), ("1.0.0", "try"), ("dev", "try"),
    ("0.31.2", "refuse"), ("0.9.2", "refuse"),
])
def test_version_policy(version, action):
    verdict = megamoe_vllm.version_verdict(version)
    assert verdict.action == action
    assert megamoe_vllm.vllm_version_supported(version) == (action == "register")
    if action == "register":
        assert verdict.message is None
    else:  # every other answer names the version seen and the tested range
        assert version in verdict.message and "0.32-0.34" in verdict.message
    if action == "refuse":
        assert "older than 0.32" in verdict.message and "NOT registered" in verdict.message
        assert "Upgrade vLLM to 0.32-0.34" in verdict.message


@pytest.fixture
def megamoe_log():
    """Records of the "megamoe" logger (which stops propagating once the core layer module is imported)."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("megamoe")
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)


@pytest.fixture
def unregistered(monkeypatch):
    """As before vLLM's first register() call in a process: the flag of done-ness off, no OOT layer
    (both restored after the test)."""
    import vllm
    from vllm.model_executor.custom_op import op_registry_oot

    monkeypatch.setattr(megamoe_vllm, "_registered", False)
    monkeypatch.delitem(op_registry_oot, "RoutedExperts")
    return lambda version: monkeypatch.setattr(vllm, "__version__", version)


def test_register_on_a_newer_minor_warns_then_registers(unregistered, megamoe_log):
    from vllm.model_executor.custom_op import op_registry_oot

    from megamoe_vllm.routed_experts import MegaMoERoutedExperts

    unregistered("0.35.0")
    megamoe_vllm.register()
    warnings = [r.getMessage() for r in megamoe_log if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "vLLM 0.35.0 is newer than the tested range 0.32-0.34" in warnings[0], warnings
    assert op_registry_oot["RoutedExperts"] is MegaMoERoutedExperts and megamoe_vllm._registered


def test_register_refuses_older_than_032(unregistered, megamoe_log):
    from vllm.model_executor.custom_op import op_registry_oot

    unregistered("0.31.2")
    megamoe_vllm.register()
    assert "RoutedExperts" not in op_registry_oot and not megamoe_vllm._registered
    assert any("vLLM 0.31.2 is older than 0.32" in r.getMessage() for r in megamoe_log)


def test_register_refuses_a_newer_minor_with_a_known_break(unregistered, megamoe_log, monkeypatch):
    """A newer vLLM without a name the plugin needs (here: EPLB's initial map builder, removed from
    the real class): nothing is registered and the log names the missing piece."""
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.model_executor.custom_op import op_registry_oot

    unregistered("0.35.0")
    monkeypatch.delattr(EplbState, "build_initial_global_physical_to_logical_map")
    megamoe_vllm.register()
    assert "RoutedExperts" not in op_registry_oot and not megamoe_vllm._registered
    refusal = megamoe_log[-1].getMessage()
    assert "vLLM 0.35.0: megamoe_ep is NOT registered" in refusal
    assert "EplbState.build_initial_global_physical_to_logical_map (vLLM's EPLB load-time map" in refusal


def test_kernel_config_accepts_backend_and_still_rejects_unknown():
    from vllm.config.kernel import KernelConfig

    assert KernelConfig(moe_backend="megamoe_ep").moe_backend == "megamoe_ep"
    assert KernelConfig(moe_backend="MegaMoE-EP").moe_backend == "megamoe_ep"  # vLLM's normaliser
    with pytest.raises(Exception, match="megamoe_typo"):
        KernelConfig(moe_backend="megamoe_typo")


def test_cli_parses_moe_backend_flag():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    assert parser.parse_args(["--moe-backend", "megamoe_ep"]).moe_backend == "megamoe_ep"
    assert parser.parse_args(["--moe-backend", "megamoe-ep"]).moe_backend == "megamoe_ep"
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-backend", "megamoe_nope"])


def test_routed_experts_oot_registered():
    from vllm.model_executor.custom_op import op_registry_oot

    from megamoe_vllm.routed_experts import MegaMoERoutedExperts

    assert op_registry_oot["RoutedExperts"] is MegaMoERoutedExperts


def _plain_w13(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """What vLLM's loader builds: w1 (gate) into the first half of w13's rows, w3 (up) into the second."""
    return torch.cat((gate, up), dim=1)


def test_bf16_mapping_interleaves_gate_up():
    e, h, i = 3, 64, 32
    gate, up = torch.randn(e, i, h).bfloat16(), torch.randn(e, i, h).bfloat16()
    w2 = torch.randn(e, h, i).bfloat16()
    w = expert_weights_from_params({"w13_weight": _plain_w13(gate, up), "w2_weight": w2},
                                   ExpertFormat("bf16", "bf16", "test"))
    assert w.gate_up_layout == "interleaved" and w.fmt == "bf16"
    assert torch.equal(w.w1[:, 0::2], gate) and torch.equal(w.w1[:, 1::2], up)
    assert torch.equal(w.w2, w2)


@pytest.mark.parametrize("layout", ["quark", "deepseek_v4"])
def test_mxfp4_mapping_is_exact(layout):
    """Quark (gate_proj/up_proj/down_proj) and DeepSeek V4 (w1/w3/w2 + .scale) checkpoints both land
    in vLLM's w13/w2 + *_weight_scale parameters; the mapping to ExpertWeights must be bit-exact."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    e, h, i = 2, 64, 64
    names = ("gate_proj", "down_proj", "up_proj") if layout == "quark" else ("w1", "w2", "w3")
    mapping = RoutedExperts.build_expert_params_mapping(*names, num_experts=e, routed_experts_prefix="")
    ckpt = {}
    for ex in range(e):
        for n, shape in ((names[0], (i, h)), (names[2], (i, h)), (names[1], (h, i))):
            q = quantize_mx(torch.randn(*shape), "fp4")
            ckpt[f"experts.{ex}.{n}.weight"] = q.data
            ckpt[f"experts.{ex}.{n}.weight_scale"] = q.scales  # V4's ".scale" after vLLM's regex mapper
    params = {"w13_weight": torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8),
              "w13_weight_scale": torch.zeros(e, 2 * i, h // 32, dtype=torch.uint8),
              "w2_weight": torch.zeros(e, h, i // 2, dtype=torch.uint8),
              "w2_weight_scale": torch.zeros(e, h, i // 32, dtype=torch.uint8)}
    hits = 0
    for ckpt_name, t in ckpt.items():
        for param_name, weight_name, expert, shard in mapping:
            if weight_name in ckpt_name + ".":  # mapping names end with "."
                suffix = ckpt_name[len(weight_name):]
                dst = params[param_name.removeprefix("experts.") + suffix][expert]
                rows = dst.shape[0] // 2
                {"w1": dst[:rows], "w3": dst[rows:], "w2": dst}[shard].copy_(t)
                hits += 1
    assert hits == len(ckpt)
    w = expert_weights_from_params(params, ExpertFormat("a4w4", "mxfp4", layout))
    w1, w2 = w.dequantized()
    for ex in range(e):
        gate = dequantize_mx_of(ckpt, f"experts.{ex}.{names[0]}")
        up = dequantize_mx_of(ckpt, f"experts.{ex}.{names[2]}")
        assert torch.equal(deinterleave_gate_up(w1[ex]), torch.cat((gate, up)))
        assert torch.equal(w2[ex], dequantize_mx_of(ckpt, f"experts.{ex}.{names[1]}"))


def dequantize_mx_of(ckpt: dict, stem: str) -> torch.Tensor:
    from megamoe_backend.formats import MXTensor

    return dequantize_mx(MXTensor(ckpt[f"{stem}.weight"], ckpt[f"{stem}.weight_scale"], "fp4"))


def test_expert_formats():
    knobs = Knobs()
    assert expert_format_of(MXFP4ExpertParams("a8w4"), knobs).quant == "a8w4"
    v4 = type("Mxfp4MoEMethod", (), {"weight_dtype": "mxfp4"})()
    assert expert_format_of(v4, knobs).quant == "a4w4"
    assert expert_format_of(v4, Knobs(aiter_force_a8w4=True)).quant == "a8w4"
    odd = type("GPTQMarlinMoEMethod", (), {})()
    with pytest.raises(UnsupportedExpertsError, match="GPTQMarlinMoEMethod are not supported"):
        expert_format_of(odd, knobs)


def _fp8_method(**attrs):
    """vLLM's Fp8MoEMethod as its constructor leaves it (the attributes the plugin reads), uninitialised."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    method = object.__new__(Fp8MoEMethod)
    block = attrs.get("weight_block_size")
    defaults = {"block_quant": block is not None, "weight_scale_refine": None, "moe_block_shape": block}
    for k, v in {**defaults, **attrs}.items():
        setattr(method, k, v)
    return method


def test_block_fp8_method_maps_to_fp8_block_and_refuses_what_it_cannot_read():
    """Fp8MoEMethod with [128, 128] blocks -> fp8_block from *_weight_scale_inv (whatever AITER_FORCE_A8W4);
    per-tensor scales, other blocks and TP-refined scales refused at layer construction, by name."""
    for force in (None, True, False):
        fmt = expert_format_of(_fp8_method(weight_block_size=[128, 128]), Knobs(aiter_force_a8w4=force))
        assert (fmt.quant, fmt.weights, fmt.scale_param) == ("fp8_block", "fp8_block", "_scale_inv")
        assert fmt.source == "Fp8MoEMethod(weight_block_size=[128, 128])"
    for attrs, needle in (
        ({"weight_block_size": None}, "without weight_block_size (per-tensor FP8 scales) is not served"),
        ({"weight_block_size": [64, 64]}, "weight_block_size [64, 64] is not served"),
        ({"weight_block_size": [128, 128], "weight_scale_refine": (2, 1), "moe_block_shape": [64, 128]},
         "refined the block scales by (2, 1) for a tensor-parallel shard"),
    ):
        with pytest.raises(UnsupportedExpertsError, match=re.escape(needle)):
            expert_format_of(_fp8_method(**attrs), Knobs())


def test_block_fp8_params_as_vllm_loads_them_become_expert_weights():
    """vLLM's Fp8MoEMethod layout ([w1 (gate); w3 (up)] rows, fp32 scale_inv per 128 x 128 block) -> ExpertWeights
    with the same bytes and scales, plain rows: the dequantised experts equal the checkpoint's per projection."""
    from megamoe_backend.formats.block_fp8 import dequantize_weight_blocks, quantize_weight_blocks

    g = torch.Generator().manual_seed(3)
    e, h, i = 2, 256, 128
    gate, up, down = (torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g) * 2,
                      torch.randn(e, h, i, generator=g))
    (qg, sg), (qu, su), (qd, sd) = (quantize_weight_blocks(t) for t in (gate, up, down))
    params = {"w13_weight": torch.cat((qg, qu), 1), "w13_weight_scale_inv": torch.cat((sg, su), 1),
              "w2_weight": qd, "w2_weight_scale_inv": sd}
    fmt = expert_format_of(_fp8_method(weight_block_size=[128, 128]), Knobs())
    w = expert_weights_from_params(params, fmt)
    assert (w.fmt, w.gate_up_layout) == ("fp8_block", "plain")
    w1, w2 = w.dequantized()
    assert torch.equal(w1[:, :i], dequantize_weight_blocks(qg, sg)) and torch.equal(w1[:, i:], dequantize_weight_blocks(qu, su))
    assert torch.equal(w2, dequantize_weight_blocks(qd, sd))
    per_tensor = {**params, "w13_weight_scale_inv": torch.ones(e, 2), "w2_weight_scale_inv": torch.ones(e)}
    with pytest.raises(UnsupportedExpertsError, match=r"w1_scale_inv has shape \(2, 2\).*per-tensor FP8 scales"):
        expert_weights_from_params(per_tensor, fmt)


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
def test_placement_matches_vllm_expert_map(strategy):
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    placement = vllm_placement(8, 4, strategy)
    for rank in range(4):
        _, expert_map, _ = determine_expert_map(4, rank, 8, strategy)
        local = placement.local_experts(rank)
        assert [int(expert_map[p]) for p in local] == list(range(len(local)))
        assert all(int(expert_map[p]) == -1 for p in range(8) if p not in local)


def _moe_config(**mpc):
    base = dict(enable_eplb=False, dp_size=1, tp_size=1, pcp_size=1, use_ep=False)
    base.update(mpc)
    return SimpleNamespace(moe_parallel_config=SimpleNamespace(**base),
                           activation=SimpleNamespace(is_gated=True, value="silu"),
                           has_bias=False, is_lora_enabled=False)


@pytest.mark.parametrize("mpc,needle", [
    ({"dp_size": 2}, "needs --enable-expert-parallel"),
    ({"tp_size": 2}, "needs --enable-expert-parallel"),
])
def test_deployment_refusals(mpc, needle):
    with pytest.raises(MegaMoEConfigError, match=needle):
        check_deployment(_moe_config(**mpc))
    check_deployment(_moe_config(use_ep=True, dp_size=2))  # the supported shape passes
    check_deployment(_moe_config(use_ep=True, dp_size=2, enable_eplb=True))  # EPLB is served (test_layer_ep)


def test_eplb_placement_from_vllms_initial_map():
    from vllm.distributed.eplb.eplb_state import EplbState

    p2l = list(EplbState.build_initial_global_physical_to_logical_map(8, 4))  # vLLM's loader map
    placement = vllm_placement(12, 4, "linear", p2l)
    assert placement.local_experts(3) == [9, 10, 11] and placement.logical_of_physical[9:] == (1, 2, 3)
    assert placement.describe() == "experts=12 logical=8 redundant/rank=0,0,1,3"


def test_bad_eplb_maps_are_startup_errors_naming_the_map():
    with pytest.raises(PlacementError, match="vLLM's EPLB physical_to_logical map has 10 physical experts, which do "
                                             "not split over 4 EP ranks"):
        vllm_placement(10, 4, "linear", [0, 1, 2, 3, 4, 5, 6, 7, 0, 1])
    with pytest.raises(PlacementError, match=r"vLLM's EPLB physical_to_logical map: logical experts \[5\] have no"):
        vllm_placement(8, 4, "linear", [0, 1, 2, 3, 4, 0, 6, 7])
    with pytest.raises(PlacementError, match=r"logical experts \[7\] have no physical replica"):  # the last one
        vllm_placement(8, 4, "linear", [0, 1, 2, 3, 4, 5, 6, 0], num_logical=8)
    with pytest.raises(PlacementError, match="map has 6 physical experts, the layer has 8"):
        vllm_placement(8, 2, "linear", [0, 1, 2, 3, 4, 5])



def test_mxfp4_params_layout():
    layer = torch.nn.Module()
    MXFP4ExpertParams("a8w4").create_weights(layer, num_experts=4, hidden_size=64, intermediate_size_per_partition=32,
                                             params_dtype=torch.bfloat16, weight_loader=None)
    assert tuple(layer.w13_weight.shape) == (4, 64, 32) and layer.w13_weight.dtype == torch.uint8
    assert tuple(layer.w13_weight_scale.shape) == (4, 64, 2)
    assert tuple(layer.w2_weight.shape) == (4, 64, 16) and tuple(layer.w2_weight_scale.shape) == (4, 64, 1)
    assert tuple(layer.w13_input_scale.shape) == (4,)
    assert layer.w13_weight_scale.quant_method == "block"



def test_batch_larger_than_mtpr_is_refused_at_startup():
    cfg = _moe_config(use_ep=True, dp_size=2)
    cfg.max_num_tokens = 16384
    with pytest.raises(MegaMoEConfigError, match="exceeds MEGA_MAX_TOKENS_PER_RANK=8192"):
        check_deployment(cfg, Knobs())
    check_deployment(cfg, Knobs(max_tokens_per_rank=16384))
