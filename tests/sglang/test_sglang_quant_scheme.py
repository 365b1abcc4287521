"""The SGLang plugin runs the scheme of tests/fixtures/quant_scheme_table.json for every (checkpoint, knob) pair.

The quant method comes from SGLang itself where it can be built without a model: SGLang's own
QuarkConfig picks the MoE scheme object from the checkpoint's ``quantization_config``
(``get_moe_scheme``), its Fp8Config + Fp8MoEMethod carry ``is_fp4_experts`` as SGLang's
ModelConfig sets it (``routed_experts_quant_method: mxfp4``, or a DeepSeek V4 model with
SGLANG_DSV4_FP4_EXPERTS, default on); no quantization gets UnquantizedFusedMoEMethod.
`megamoe info` and the vLLM plugin are held to the same table (tests/core, tests/vllm).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megamoe_backend.experts import A_OPERAND
from megamoe_backend.knobs import Knobs
from megamoe_backend.plan.layer_plan import check_wire_matches_quant
from megamoe_sglang.weights import UnsupportedExpertsError, expert_format_of

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TABLE = json.loads((FIXTURES / "quant_scheme_table.json").read_text())["rows"]


def sglang_routed_experts_method(config: dict) -> tuple[object, object]:
    """(quant method, Quark scheme or None) SGLang builds for ``config``'s routed experts."""
    from sglang.srt import environ
    from sglang.srt.configs.model_config import is_deepseek_v4
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod
    from sglang.srt.layers.quantization.quark.quark import QuarkConfig, QuarkFusedMoEMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    text = config.get("text_config", config)
    qcfg = text.get("quantization_config", config.get("quantization_config"))
    if not qcfg:
        return object.__new__(UnquantizedFusedMoEMethod), None
    if qcfg["quant_method"] == "quark":
        qcfg = dict(qcfg, packed_modules_mapping={})  # what SGLang's loader adds (get_quant_config)
        scheme = QuarkConfig.from_config(qcfg).get_moe_scheme(
            torch.nn.Module(), "model.layers.3.mlp.experts", quantize_shared_expert_online=False
        )
        return object.__new__(QuarkFusedMoEMethod), scheme
    quant_config = Fp8Config.from_config(qcfg)
    # SGLang's ModelConfig (configs/model_config.py) decides is_fp4_experts; the loader copies it onto the config.
    fp4 = qcfg.get("routed_experts_quant_method") == "mxfp4"
    if is_deepseek_v4(SimpleNamespace(**text)) and qcfg.get("routed_experts_quant_method") is None:
        fp4 = environ.envs.SGLANG_DSV4_FP4_EXPERTS.get()
    quant_config.is_fp4_experts = fp4
    method = object.__new__(Fp8MoEMethod)
    method.is_fp4_expert = quant_config.is_fp4_experts  # what Fp8MoEMethod.__init__ copies
    return method, None


@pytest.mark.parametrize("row", TABLE, ids=lambda r: f"{r['checkpoint']}-force={r['AITER_FORCE_A8W4']}")
def test_sglang_plugin_runs_the_table_scheme(row) -> None:
    config = json.loads((FIXTURES / row["checkpoint"]).read_text())
    env = {} if row["AITER_FORCE_A8W4"] is None else {"AITER_FORCE_A8W4": row["AITER_FORCE_A8W4"]}
    knobs = Knobs.from_env(env)
    method, scheme = sglang_routed_experts_method(config)
    if row["scheme"] == "refused":
        with pytest.raises(UnsupportedExpertsError, match="block-FP8"):
            expert_format_of(method, knobs.aiter_force_a8w4, scheme=scheme)
        return
    fmt = expert_format_of(method, knobs.aiter_force_a8w4, scheme=scheme)
    assert fmt.quant == row["scheme"], fmt
    assert fmt.weights == ("bf16" if row["scheme"] == "bf16" else "mxfp4")
    check_wire_matches_quant(A_OPERAND[fmt.quant] or "bf16", fmt.quant)  # e.g. fp8 wire for forced A8W4: legal
