"""Named shapes of the models the backend is built for, so ``megamoe info --preset`` needs no download."""

from __future__ import annotations

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


def preset(name: str) -> MoESpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}") from None
