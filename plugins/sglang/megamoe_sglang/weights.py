"""SGLang's loaded routed-expert parameters -> MegaMoE ``ExpertWeights``.

Why convert *after* SGLang loaded them: SGLang's quant method creates the ``FusedMoE`` parameters
and its weight loaders fill them from every checkpoint layout SGLang knows (DeepSeek V3/R1
``gate_proj/up_proj/down_proj``, DeepSeek V4 ``w1/w3/w2``, Quark MXFP4, EP slicing, EPLB
physical replicas). After loading, each family has one fixed layout, which is all this module maps:

=============================  ==================================================================
SGLang quant method            loaded parameters (E = local experts, I = intermediate, H = hidden)
=============================  ==================================================================
UnquantizedFusedMoEMethod      ``w13_weight`` [E, 2I, H] bf16 (gate rows, then up rows),
(DeepSeek V3/R1 bf16)          ``w2_weight`` [E, H, I]
QuarkW4A4MXFp4MoE /            ``w13_weight`` [E, 2Ip, H/2] uint8 (e2m1 pairs, even element low),
QuarkW4A8MXFp4MoE              ``w13_weight_scale`` [E, 2Ip, H/32] uint8 E8M0, ``w2_weight``
(Quark MXFP4 A4W4 / A8W4)      [E, H, Ip/2], ``w2_weight_scale`` [E, H, Ip/32]; Ip = I + padding
                               (``layer.intermediate_pad``, zero rows SGLang adds for aiter)
Fp8MoEMethod, block FP8       ``w13_weight`` [E, 2I, H] float8_e4m3fn (gate rows, then up rows),
(DeepSeek V3/R1 FP8,           ``w13_weight_scale_inv`` [E, 2I/128, H/128] fp32, one per 128x128
weight_block_size [128, 128])  block; ``w2_weight`` [E, H, I], ``w2_weight_scale_inv`` [E, H/128, I/128]
Fp8MoEMethod, fp4 experts      ``w13_weight`` [E, 2I, H/2] int8 (e2m1 pairs), scales in
(DeepSeek V4 ``expert_dtype``  ``w13_weight_scale_inv`` [E, 2I, H/32] as float8_e8m0fnu (ROCm/XPU)
fp4)                           or float32 powers of two (CUDA); same for ``w2_*``
=============================  ==================================================================

This module only reads SGLang's quant-method classes, where they keep the scales and, where SGLang
names it, the activation format SGLang itself runs the experts with (the engine's reading: in 0.5.23
only DeepSeek V4.1 on aiter, ``FusedMoE.fp8_activations``; plain V4 names none). The conversion
(interleave, padding, E8M0) and which scheme and dispatch wire run (the reading, ``AITER_FORCE_A8W4``,
``MEGA_DISPATCH_WIRE``: ``spec.choose_scheme``) are core's, shared with ``megamoe info`` and the vLLM plugin.
"""

from __future__ import annotations

from typing import Any

from megamoe_backend.experts.loaded import (
    ExpertFormat,
    UnsupportedExpertsError,
    e8m0_bytes,
    expert_format,
    expert_weights_from_params,
)
from megamoe_backend.formats.block_fp8 import BlockFP8Error, check_weight_block_size
from megamoe_backend.knobs import Knobs
from megamoe_backend.spec import EngineReading, SchemeChoice, choose_scheme, log_override

FLAG = "--moe-a2a-backend megamoe_ep"
_QUARK_SCHEMES = {"QuarkW4A4MXFp4MoE": "a4w4", "QuarkW4A8MXFp4MoE": "a8w4"}


def declared_scheme(quant_method: object, scheme: object = None) -> tuple[str, str, str]:
    """(scheme the checkpoint declares, scale-parameter suffix, source) for SGLang's quant method.

    ``QuarkFusedMoEMethod`` delegates to a scheme object (SGLang keeps it on the layer,
    ``layer.scheme``; pass it as ``scheme``) whose class names the activation format. DeepSeek V4
    fp4 experts declare no activation format: A4W4, as upstream MegaMoE runs them (SGLang's own
    reading, where it has one, is ``engine_reading``'s).
    """
    name = type(quant_method).__name__
    if name == "UnquantizedFusedMoEMethod":
        return "bf16", "_scale", name
    if name == "QuarkFusedMoEMethod":
        scheme = type(scheme if scheme is not None else getattr(quant_method, "scheme", None)).__name__
        if scheme in _QUARK_SCHEMES:
            return _QUARK_SCHEMES[scheme], "_scale", f"{name}({scheme})"
        raise UnsupportedExpertsError(
            f"{FLAG}: Quark MoE scheme {scheme} is not supported; MegaMoE serves "
            "MXFP4 weights with MXFP4 (A4W4) or FP8 (A8W4) activations"
        )
    if name == "Fp8MoEMethod":  # block FP8, or DeepSeek V4's fp4 experts under the fp8 config
        if getattr(quant_method, "is_fp4_expert", False):
            return "a4w4", "_scale_inv", f"{name}(fp4 experts)"
        check_block_fp8_method(quant_method)
        return "fp8_block", "_scale_inv", f"{name}(fp8 experts, weight_block_size={list(quant_method.weight_block_size)})"
    raise UnsupportedExpertsError(
        f"{FLAG}: routed experts quantised with {name} are not supported; MegaMoE serves bf16, block-FP8 "
        "(DeepSeek V3 / R1 FP8, weight_block_size [128, 128]), Quark MXFP4 (A4W4 / A8W4) and DeepSeek V4 fp4 experts"
    )


def check_block_fp8_method(quant_method: object) -> None:
    """SGLang's ``Fp8MoEMethod`` for fp8 experts must hold 128 x 128 block scales: refuse (naming
    ``weight_block_size``) per-tensor scales, another block size, or MXFP8 (``use_mxfp8``: E8M0 scales per
    1x32, a different checkpoint format)."""
    if getattr(quant_method, "use_mxfp8", False):
        raise UnsupportedExpertsError(f"{FLAG}: SGLang's Fp8MoEMethod loads MXFP8 experts (use_mxfp8); MegaMoE serves "
                                      "block-FP8 experts with weight_block_size [128, 128] and fp32 scales")
    try:
        check_weight_block_size(getattr(quant_method, "weight_block_size", None), f"{FLAG}: SGLang's Fp8MoEMethod")
    except BlockFP8Error as exc:
        raise UnsupportedExpertsError(str(exc)) from None


def engine_reading(quant_method: object, layer: object = None) -> EngineReading | None:
    """The activation format SGLang names for the layer's MXFP4 experts, or None where it names none.

    SGLang 0.5.23's DeepSeek V4 decoder sets ``experts.fp8_activations`` (True for model_type
    deepseek_v41) when it runs aiter on ROCm, and its aiter runner then quantises the activations to
    fp8 for the fp4 experts (``Fp8MoEMethod`` ... ``fp8_activations=is_fp4_expert and layer.fp8_activations``).
    """
    fp4_experts = type(quant_method).__name__ == "Fp8MoEMethod" and getattr(quant_method, "is_fp4_expert", False)
    if fp4_experts and getattr(layer, "fp8_activations", False) is True:
        return EngineReading("a8w4", "SGLang FusedMoE.fp8_activations (DeepSeek V4.1 on aiter)")
    return None


def scheme_choice_of(quant_method: object, knobs: Knobs | None = None, scheme: object = None,
                     layer: object = None) -> SchemeChoice:
    """The scheme and dispatch wire MegaMoE runs for the layer's quant method under the knobs (core decides)."""
    declared, _, _ = declared_scheme(quant_method, scheme)
    return choose_scheme(declared, engine_reading(quant_method, layer), knobs or Knobs(), FLAG)


def expert_format_of(quant_method: object, knobs: Knobs | None = None, scheme: object = None,
                     layer: object = None) -> ExpertFormat:
    """What MegaMoE runs for the layer's quant method under the knobs (``scheme_choice_of``), as an ExpertFormat."""
    _, scale_param, source = declared_scheme(quant_method, scheme)
    return expert_format(scheme_choice_of(quant_method, knobs, scheme, layer), source, scale_param)


def layer_scheme(layer: Any, knobs: Knobs) -> tuple[ExpertFormat, Knobs]:
    """An SGLang FusedMoE's ExpertFormat and the knobs its plan is built from (the dispatch wire the
    scheme choice runs); logs, once per process, a knob that overrode SGLang's reading."""
    qm, scheme = layer.quant_method, getattr(layer, "scheme", None)
    choice = scheme_choice_of(qm, knobs, scheme, layer)
    log_override(choice)
    _, scale_param, source = declared_scheme(qm, scheme)
    return expert_format(choice, source, scale_param), choice.knobs_for_layer(knobs)


__all__ = ["ExpertFormat", "UnsupportedExpertsError", "check_block_fp8_method", "declared_scheme", "e8m0_bytes", "engine_reading",
           "expert_format_of", "expert_weights_from_params", "layer_scheme", "scheme_choice_of"]
