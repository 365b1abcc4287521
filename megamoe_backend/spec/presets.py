"""Named shapes of the models the backend is built for, so ``megamoe info --preset`` needs no download.

``PRESET_CONFIGS`` holds, per preset, the config.json keys an engine's quant method reads the experts'
activation format from (``engine_reading.reading_for_config``), as the published checkpoints have them, so
``megamoe info --preset dsv4-pro --engine vllm-0.33`` (and the serve scripts' check of a Hugging Face id
they cannot read) answers what that engine runs for the checkpoint.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from .moe_spec import MoESpec

PRESETS: dict[str, MoESpec] = {
    "dsv4-pro": MoESpec(
        name="dsv4-pro",
        model_type="deepseek_v4",
        hidden_size=7168,
        moe_intermediate_size=3072,
        n_routed_experts=384,
        num_experts_per_tok=6,
        n_shared_experts=1,
        num_hidden_layers=61,
        scoring_func="sqrtsoftplus",
        topk_method="noaux_tc",
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        swiglu_limit=10.0,
        quant="a4w4",
    ),
    "r1-mxfp4": MoESpec(
        name="r1-mxfp4",
        model_type="deepseek_v3",
        hidden_size=7168,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        num_experts_per_tok=8,
        n_shared_experts=1,
        first_k_dense_replace=3,
        num_hidden_layers=61,
        n_group=8,
        topk_group=4,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        quant="a4w4",
    ),
}
# deepseek-ai/DeepSeek-R1 (and DeepSeek-V3, the same config): R1's shapes, block-FP8 experts (weight_block_size [128, 128])
PRESETS["r1-fp8"] = replace(PRESETS["r1-mxfp4"], name="r1-fp8", quant="fp8_block")


# deepseek-ai/DeepSeek-V4-Pro: block-FP8 config, MXFP4 routed experts (expert_dtype fp4);
# amd/DeepSeek-R1-0528-MXFP4: Quark MXFP4 weights and activations (A4W4); deepseek-ai/DeepSeek-R1: block FP8.
_MXFP4_GROUP = {"qscheme": "per_group", "group_size": 32, "ch_axis": -1, "scale_format": "e8m0"}
PRESET_CONFIGS: dict[str, Mapping[str, Any]] = {
    "dsv4-pro": {
        "model_type": "deepseek_v4",
        "expert_dtype": "fp4",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    },
    "r1-mxfp4": {
        "model_type": "deepseek_v3",
        "quantization_config": {"quant_method": "quark", "global_quant_config": {
            "weight": {"dtype": "fp4", **_MXFP4_GROUP, "is_dynamic": False},
            "input_tensors": {"dtype": "fp4", **_MXFP4_GROUP, "is_dynamic": True}}},
    },
    "r1-fp8": {
        "model_type": "deepseek_v3",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    },
}


def preset_config(name: str) -> Mapping[str, Any]:
    """The config.json keys of preset ``name``'s checkpoint that an engine's reading looks at."""
    preset(name)  # the same error for an unknown name
    return PRESET_CONFIGS[name]


def preset(name: str) -> MoESpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"--preset {name!r} is not a preset; available: {', '.join(sorted(PRESETS))} "
                         "(or --model CONFIG.json for another checkpoint)") from None
