"""What the vLLM plugin runs for each quant-scheme table row, on the vLLM installed in this interpreter.

Run as ``python quant_scheme_probe.py < rows.json`` (one process: vLLM's distributed state is set up once).
For each row it builds the routed experts as vLLM does for that checkpoint: vLLM's own quant config
(``DeepseekV4FP8Config`` for DeepSeek V4's fp8 config, ``QuarkConfig``, ``Fp8Config``, none) handed to vLLM's
``FusedMoEFactory`` under ``--moe-backend megamoe_ep``, so vLLM's quant config builds its quant method
(``Mxfp4MoEMethod(moe, activation_key=...)`` for V4 fp4 experts; on this CPU its kernel oracle raises and the
plugin keeps the key vLLM passed) and the plugin's ``RoutedExperts`` wraps it, reading the row's knobs from
the environment as a server does. It prints one JSON result per row: the scheme and dispatch wire the
layer's ``MegaMoEMethod`` holds (the ones its plan is built from), the knob that overrode the engine's
reading and the startup lines saying so (two layers are built per row: one line), or the refusal.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
KNOB_VARS = ("MEGA_DISPATCH_WIRE", "MEGA_WIRE", "AITER_FORCE_A8W4")


def vllm_quant_config(config: dict):
    """The quant config vLLM builds for ``config`` (None: unquantised)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig
    from vllm.models.deepseek_v4 import DeepseekV4FP8Config

    text = config.get("text_config", config)
    qcfg = text.get("quantization_config", config.get("quantization_config"))
    if not qcfg:
        return None
    if DeepseekV4FP8Config.override_quantization_method(qcfg, None, SimpleNamespace(model_type=text.get("model_type"))):
        return DeepseekV4FP8Config.from_config(qcfg)
    if qcfg["quant_method"] == "quark":
        return QuarkConfig.from_config(qcfg)
    return Fp8Config.from_config(qcfg)


def probe_row(vcfg, index: int, row: dict) -> dict:
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    from megamoe_backend.plan.layer_plan import check_wire_matches_quant
    from megamoe_backend.spec import expert_scheme
    from megamoe_vllm.routed_experts import process_knobs
    from megamoe_vllm.weights import scheme_choice_of

    for name in KNOB_VARS:
        os.environ.pop(name, None)
    for name, value in (("AITER_FORCE_A8W4", row["AITER_FORCE_A8W4"]), ("MEGA_DISPATCH_WIRE", row["MEGA_DISPATCH_WIRE"])):
        if value is not None:
            os.environ[name] = value
    process_knobs.cache_clear()  # the plugin reads the knobs once per process; each row is a new "server"
    config = json.loads((FIXTURES / row["checkpoint"]).read_text())
    # The model config vLLM's quant methods read while building (DeepseekV4FP8Config: hf_config.expert_dtype /
    # quantization_config.moe_quant_algo; the MXFP4 oracle: quantization_config, the --quantization-config override).
    hf = SimpleNamespace(**config.get("text_config", config))
    vcfg.model_config = SimpleNamespace(hf_config=hf, hf_text_config=hf, dtype=torch.bfloat16, quantization_config=None)
    expert_scheme._warn_once.cache_clear()  # the once-per-process startup line, fresh for this "server"
    LINES.clear()
    try:
        for layer_index in (2 * index, 2 * index + 1):  # two MoE layers of one model: one override line
            layer = FusedMoEFactory(
                num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, params_dtype=torch.bfloat16,
                renormalize=True, prefix=f"model.layers.{layer_index}.mlp.experts",
                quant_config=vllm_quant_config(config), scoring_func="sigmoid",
            )
        method = layer.routed_experts.quant_method
        check_wire_matches_quant(method.knobs.dispatch_wire, method.fmt.quant)  # build_plan's first check
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {"refused": f"{type(exc).__name__}: {exc}"}
    return {"scheme": method.fmt.quant, "wire": method.knobs.dispatch_wire,
            "overridden_by": scheme_choice_of(method.inner, process_knobs()).overridden_by,
            "override_lines": [line for line in LINES if "engine's reading" in line],
            "inner": type(method.inner).__name__}


class _Lines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        LINES.append(record.getMessage())


LINES: list[str] = []  # what logger "megamoe" said while building the current row's layers


def main() -> None:
    import megamoe_vllm
    from vllm.config import set_current_vllm_config

    from layer_harness import init_ranks, vllm_config

    rows = json.load(sys.stdin)
    logging.getLogger("megamoe").addHandler(_Lines())
    megamoe_vllm.register()
    vcfg = vllm_config(1, "megamoe_ep")
    with set_current_vllm_config(vcfg):
        init_ranks(0, 1, int(os.environ.get("PROBE_PORT", "29655")))
        results = [probe_row(vcfg, i, row) for i, row in enumerate(rows)]  # one layer name each
    print("PROBE_RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
