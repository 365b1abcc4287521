"""The SGLang plugin runs the scheme and wire of tests/fixtures/quant_scheme_table.json for every sglang-0.5.23 row.

The quant method comes from SGLang itself where it can be built without a model: SGLang's own
QuarkConfig picks the MoE scheme object from the checkpoint's ``quantization_config``
(``get_moe_scheme``), its Fp8Config + Fp8MoEMethod carry ``is_fp4_experts`` as SGLang's
ModelConfig sets it (``routed_experts_quant_method: mxfp4``, or a DeepSeek V4 model with
SGLANG_DSV4_FP4_EXPERTS, default on); no quantization gets UnquantizedFusedMoEMethod. The layer the
plugin reads carries what SGLang's FusedMoE carries on this platform (quant method, Quark scheme; no
``fp8_activations``: SGLang 0.5.23 sets that only for DeepSeek V4.1 on aiter, tested separately below,
against `megamoe info --engine sglang-0.5.23 --device rocm`). The plugin's decision is
``weights.layer_scheme``, what ``runtime.convert_layer_weights`` / ``build_layer_runtime`` call.
`megamoe info` and the vLLM plugin are held to the same table (tests/core, tests/vllm).

Planted mutation (run once, then restored): ``engine_reading`` in plugins/sglang/megamoe_sglang/weights.py
returning None (SGLang's ``fp8_activations`` ignored): 3 failed (the V4.1-on-aiter cases), 24 passed -- the
table rows pass either way, since SGLang 0.5.23 names no activation format for DeepSeek V4.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import sglang
import torch

from megamoe_backend.knobs import KnobError, Knobs
from megamoe_backend.plan.layer_plan import check_wire_matches_quant
from megamoe_sglang.weights import UnsupportedExpertsError, engine_reading, layer_scheme, scheme_choice_of

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
    # what Fp8MoEMethod.__init__ copies from the config (its constructor also asks the MoE runner backend,
    # which needs a started server)
    method.is_fp4_expert = quant_config.is_fp4_experts
    method.use_mxfp8 = getattr(quant_config, "use_mxfp8", False)
    method.weight_block_size = quant_config.weight_block_size
    method.block_quant = method.use_mxfp8 or method.weight_block_size is not None
    return method, None


def row_id(row: dict) -> str:
    return f"{row['engine']}-{row['checkpoint']}-force={row['AITER_FORCE_A8W4']}-wire={row['MEGA_DISPATCH_WIRE']}"


def knob_env(force: str | None, wire: str | None) -> dict[str, str]:
    return {k: v for k, v in (("AITER_FORCE_A8W4", force), ("MEGA_DISPATCH_WIRE", wire)) if v is not None}


@pytest.mark.parametrize("row", [r for r in TABLE if r["engine"] == f"sglang-{sglang.__version__}"], ids=row_id)
def test_sglang_plugin_runs_the_table_row(row) -> None:
    config = json.loads((FIXTURES / row["checkpoint"]).read_text())
    knobs = Knobs.from_env(knob_env(row["AITER_FORCE_A8W4"], row["MEGA_DISPATCH_WIRE"]))
    method, scheme = sglang_routed_experts_method(config)
    layer = SimpleNamespace(quant_method=method, scheme=scheme)
    if row["scheme"] == "refused":
        with pytest.raises((UnsupportedExpertsError, KnobError), match=re.escape(row["refusal"])):
            fmt, layer_knobs = layer_scheme(layer, knobs)
            check_wire_matches_quant(layer_knobs.dispatch_wire, fmt.quant)  # convert_layer_weights' check
        return
    fmt, layer_knobs = layer_scheme(layer, knobs)
    check_wire_matches_quant(layer_knobs.dispatch_wire, fmt.quant)
    overridden = scheme_choice_of(method, knobs, scheme, layer).overridden_by
    assert (fmt.quant, layer_knobs.dispatch_wire, overridden) == (row["scheme"], row["wire"], row["overridden_by"])
    assert fmt.weights == {"bf16": "bf16", "fp8_block": "fp8_block"}.get(row["scheme"], "mxfp4")
    if row["scheme"] == "fp8_block":  # SGLang's Fp8MoEMethod names the fp32 block scales w13_weight_scale_inv
        assert fmt.scale_param == "_scale_inv"


def test_table_has_rows_for_this_sglang() -> None:
    assert sum(r["engine"] == f"sglang-{sglang.__version__}" for r in TABLE) == 26


@pytest.fixture()
def v41_config(tmp_path) -> Path:
    """DeepSeek V4.1 with fp4 experts (V4 Pro's shapes): the model SGLang 0.5.23 runs on MXFP8 activations on aiter."""
    config = json.loads((FIXTURES / "dsv4_pro_fp4_experts_config.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, "model_type": "deepseek_v41"}))
    return path


@pytest.mark.parametrize("force, wire, expect", [
    (None, None, ("a8w4", "fp8", None)),
    ("0", None, ("a4w4", "bf16", "AITER_FORCE_A8W4=0")),
    (None, "fp4", ("a4w4", "fp4", "MEGA_DISPATCH_WIRE=fp4")),
])
def test_v41_on_aiter_follows_sglangs_fp8_activations_as_info_does(force, wire, expect, v41_config, monkeypatch,
                                                                     capsys, caplog) -> None:
    """SGLang's decoder sets ``experts.fp8_activations = model_type == "deepseek_v41"`` when it runs aiter
    (SGLANG_USE_AITER on ROCm): the plugin reads that layer attribute; info reads the same from the release."""
    from megamoe_backend.cli.main import main
    from megamoe_backend.spec import expert_scheme

    config = json.loads(v41_config.read_text())
    method, scheme = sglang_routed_experts_method(config)
    layer = SimpleNamespace(quant_method=method, scheme=scheme, fp8_activations=True)
    expert_scheme._warn_once.cache_clear()  # the once-per-process line, fresh for this case
    with caplog.at_level(logging.WARNING, logger="megamoe"):
        fmt, layer_knobs = layer_scheme(layer, Knobs.from_env(knob_env(force, wire)))
    overridden = scheme_choice_of(method, Knobs.from_env(knob_env(force, wire)), scheme, layer).overridden_by
    assert (fmt.quant, layer_knobs.dispatch_wire, overridden) == expect
    lines = [r.getMessage() for r in caplog.records if "engine's reading" in r.getMessage()]
    assert len(lines) == (0 if expect[2] is None else 1), lines
    if expect[2]:
        assert f"is overridden by {expect[2]}: experts run {expect[0]}, dispatch wire {expect[1]}" in lines[0]

    for name in ("AITER_FORCE_A8W4", "MEGA_DISPATCH_WIRE", "MEGA_WIRE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in knob_env(force, wire).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SGLANG_USE_AITER", "1")
    assert main(["info", "--model", str(v41_config), "--device", "rocm", "--engine", f"sglang-{sglang.__version__}",
                 "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["spec"]["quant"], info["scheme"]["dispatch_wire"], info["scheme"]["overridden_by"]) == expect


def test_v4_without_fp8_activations_names_no_reading() -> None:
    """Plain DeepSeek V4 (SGLang sets no fp8_activations): the checkpoint's own A4W4, bf16 wire."""
    config = json.loads((FIXTURES / "dsv4_pro_fp4_experts_config.json").read_text())
    method, scheme = sglang_routed_experts_method(config)
    assert engine_reading(method, SimpleNamespace(quant_method=method)) is None
    fmt, knobs = layer_scheme(SimpleNamespace(quant_method=method, scheme=scheme), Knobs.from_env({}))
    assert (fmt.quant, knobs.dispatch_wire) == ("a4w4", "bf16")
