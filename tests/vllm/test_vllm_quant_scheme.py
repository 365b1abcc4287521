"""The vLLM plugin runs the scheme of tests/fixtures/quant_scheme_table.json for every (checkpoint, knob) pair.

The quant method comes from vLLM itself where it can be built without a model: vLLM's own
QuarkConfig / DeepseekV4FP8Config parse the checkpoint's ``quantization_config`` and, as on a CPU
without an MXFP4 MoE kernel, the plugin's fallback declares the parameters (``_mxfp4_params_or_raise``);
a checkpoint without quantization gets vLLM's UnquantizedFusedMoEMethod, block FP8 its Fp8MoEMethod.
`megamoe info` is held to the same table in tests/core/test_info_quant_scheme.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megamoe_backend.experts import A_OPERAND
from megamoe_backend.knobs import Knobs
from megamoe_backend.plan.layer_plan import check_wire_matches_quant
from megamoe_vllm.routed_experts import _mxfp4_params_or_raise
from megamoe_vllm.weights import UnsupportedExpertsError, expert_format_of

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TABLE = json.loads((FIXTURES / "quant_scheme_table.json").read_text())["rows"]


def _bare(cls: type) -> object:
    """A real vLLM quant-method object, left uninitialised (only its class matters to the plugin)."""
    return object.__new__(cls)


def vllm_routed_experts_method(config: dict) -> object:
    """The routed-experts quant method vLLM builds for ``config`` on this (CPU) platform."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod
    from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig
    from vllm.models.deepseek_v4 import DeepseekV4FP8Config

    text = config.get("text_config", config)
    qcfg = text.get("quantization_config", config.get("quantization_config"))
    if not qcfg:
        return _bare(UnquantizedFusedMoEMethod)
    hf = SimpleNamespace(model_type=text.get("model_type"))
    if DeepseekV4FP8Config.override_quantization_method(qcfg, None, hf) == "deepseek_v4_fp8":
        quant_config = DeepseekV4FP8Config.from_config(qcfg)
        if text.get("expert_dtype", "fp4") != "fp4":
            return _bare(Fp8MoEMethod)
    elif qcfg["quant_method"] == "quark":
        quant_config = QuarkConfig.from_config(qcfg)
    else:
        assert Fp8Config.from_config(qcfg).get_name() == "fp8"
        return _bare(Fp8MoEMethod)
    # No MXFP4 MoE kernel on this platform: vLLM raises NotImplementedError and the plugin declares the parameters.
    return _mxfp4_params_or_raise(quant_config, NotImplementedError("no MXFP4 MoE kernel here"))


@pytest.mark.parametrize("row", TABLE, ids=lambda r: f"{r['checkpoint']}-force={r['AITER_FORCE_A8W4']}")
def test_vllm_plugin_runs_the_table_scheme(row) -> None:
    config = json.loads((FIXTURES / row["checkpoint"]).read_text())
    env = {} if row["AITER_FORCE_A8W4"] is None else {"AITER_FORCE_A8W4": row["AITER_FORCE_A8W4"]}
    knobs = Knobs.from_env(env)
    method = vllm_routed_experts_method(config)
    if row["scheme"] == "refused":
        with pytest.raises(UnsupportedExpertsError):
            expert_format_of(method, knobs)
        return
    fmt = expert_format_of(method, knobs)
    assert fmt.quant == row["scheme"], fmt
    assert fmt.weights == ("bf16" if row["scheme"] == "bf16" else "mxfp4")
    check_wire_matches_quant(A_OPERAND[fmt.quant] or "bf16", fmt.quant)  # e.g. fp8 wire for forced A8W4: legal


@pytest.mark.parametrize("scheme, declared", [("w_mxfp4_a_mxfp4", "a4w4"), ("w_mxfp4_a_fp8", "a8w4")])
def test_vllm_gpu_quark_method_follows_the_knob_too(scheme, declared) -> None:
    """Where vLLM has an MXFP4 MoE kernel it builds QuarkOCP_MX_MoEMethod itself; same decision."""
    from vllm.model_executor.layers.quantization.quark.quark_moe import QuarkOCP_MX_MoEMethod

    method = _bare(QuarkOCP_MX_MoEMethod)
    method.ocp_mx_scheme, method.weight_dtype = scheme, "mxfp4"
    assert expert_format_of(method, Knobs()).quant == declared
    assert expert_format_of(method, Knobs(aiter_force_a8w4=True)).quant == "a8w4"
    assert expert_format_of(method, Knobs(aiter_force_a8w4=False)).quant == declared
