"""MoESpec from real-shaped config.json files (tests/fixtures) and the presets."""

from __future__ import annotations

import json

import pytest

from megamoe_backend.spec import ConfigError, MoESpec, preset, quant_scheme_from_config


def test_dsv4_pro_config(fixtures) -> None:
    s = MoESpec.from_config(fixtures / "dsv4_pro_config.json")
    assert (s.hidden_size, s.moe_intermediate_size, s.n_routed_experts, s.num_experts_per_tok) == (7168, 3072, 384, 6)
    assert (s.scoring_func, s.topk_method, s.swiglu_limit, s.routed_scaling_factor) == ("sqrtsoftplus", "noaux_tc", 10.0, 2.5)
    assert s.quant == "a4w4"
    assert s == preset("dsv4-pro").scaled(name=s.name)


def test_r1_mxfp4_config_matches_preset(fixtures) -> None:
    s = MoESpec.from_config(fixtures / "r1_mxfp4_config.json")
    assert (s.n_group, s.topk_group, s.first_k_dense_replace, s.scoring_func) == (8, 4, 3, "sigmoid")
    assert s.quant == "a4w4"
    assert s.num_moe_layers == 58
    assert s == preset("r1-mxfp4").scaled(name=s.name)


def test_quark_fp8_inputs_is_a8w4(fixtures) -> None:
    assert MoESpec.from_config(fixtures / "r1_mxfp4_a8w4_config.json").quant == "a8w4"


def test_deepseek_block_fp8(fixtures) -> None:
    assert MoESpec.from_config(fixtures / "deepseek_v3_fp8_config.json").quant == "fp8_block"


def test_deepseek_v4_fp8_config_has_mxfp4_experts(fixtures) -> None:
    """V4 keeps quant_method fp8 for attention / linears; its routed experts are MXFP4 (expert_dtype fp4,
    the default for a deepseek_v4 model in vLLM and SGLang), block FP8 only when expert_dtype says fp8."""
    s = MoESpec.from_config(fixtures / "dsv4_pro_fp4_experts_config.json")
    assert s.quant == "a4w4" and s == preset("dsv4-pro").scaled(name=s.name)
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert quant_scheme_from_config(fp8, None, "deepseek_v4") == "a4w4"
    assert quant_scheme_from_config(fp8, "fp8", "deepseek_v4") == "fp8_block"
    assert quant_scheme_from_config(fp8, None, "deepseek_v3") == "fp8_block"
    assert quant_scheme_from_config({**fp8, "routed_experts_quant_method": "mxfp4"}, None, "deepseek_v3") == "a4w4"
    with pytest.raises(ConfigError, match="expert_dtype='int4'"):
        quant_scheme_from_config(fp8, "int4", "deepseek_v4")


def test_nested_text_config(fixtures) -> None:
    s = MoESpec.from_config(fixtures / "nested_text_config.json")
    assert s.n_routed_experts == 256 and s.quant == "bf16"


def test_missing_required_key_names_it(fixtures) -> None:
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        MoESpec.from_config(fixtures / "missing_key_config.json")


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="not found"):
        MoESpec.from_config("/nonexistent/config.json")


@pytest.mark.parametrize(
    "qcfg, message",
    [
        ({"quant_method": "awq"}, "awq"),
        ({"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "int8"}}}, "int8"),
        ({"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "fp4", "group_size": 16}}}, "group_size=16"),
        ({"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "fp4"}, "input_tensors": {"dtype": "int8"}}}, "int8"),
    ],
)
def test_unsupported_quant_configs_are_refused(qcfg, message) -> None:
    with pytest.raises(ConfigError, match=message):
        quant_scheme_from_config(qcfg)


def test_bad_values_are_refused() -> None:
    base = json.loads('{"hidden_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2}')
    with pytest.raises(ConfigError, match="scoring_func"):
        MoESpec.from_config({**base, "scoring_func": "relu"})
    with pytest.raises(ConfigError, match="n_group"):
        MoESpec.from_config({**base, "n_group": 3})
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        MoESpec.from_config({**base, "num_experts_per_tok": 9})


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="dsv4-pro"):
        preset("nope")
