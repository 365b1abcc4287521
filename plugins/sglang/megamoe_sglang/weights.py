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
Fp8MoEMethod, fp4 experts      ``w13_weight`` [E, 2I, H/2] int8 (e2m1 pairs), scales in
(DeepSeek V4 ``expert_dtype``  ``w13_weight_scale_inv`` [E, 2I, H/32] as float8_e8m0fnu (ROCm/XPU)
fp4)                           or float32 powers of two (CUDA); same for ``w2_*``
=============================  ==================================================================

This module only reads SGLang's quant-method classes and where they keep the scales; the
conversion (interleave, padding, E8M0) and which scheme runs (``AITER_FORCE_A8W4``) are core's
(``megamoe_backend.experts.loaded``), shared with ``megamoe info`` and the vLLM plugin.
"""

from __future__ import annotations

from megamoe_backend.experts.loaded import (
    ExpertFormat,
    UnsupportedExpertsError,
    e8m0_bytes,
    expert_format,
    expert_weights_from_params,
)

FLAG = "--moe-a2a-backend megamoe_ep"
_QUARK_SCHEMES = {"QuarkW4A4MXFp4MoE": "a4w4", "QuarkW4A8MXFp4MoE": "a8w4"}


def declared_scheme(quant_method: object, scheme: object = None) -> tuple[str, str, str]:
    """(scheme the checkpoint declares, scale-parameter suffix, source) for SGLang's quant method.

    ``QuarkFusedMoEMethod`` delegates to a scheme object (SGLang keeps it on the layer,
    ``layer.scheme``; pass it as ``scheme``) whose class names the activation format. DeepSeek V4
    fp4 experts declare no activation format: A4W4, as upstream MegaMoE runs them.
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
        fp4 = getattr(quant_method, "is_fp4_expert", False)
        return ("a4w4" if fp4 else "fp8_block"), "_scale_inv", f"{name}({'fp4' if fp4 else 'fp8'} experts)"
    raise UnsupportedExpertsError(
        f"{FLAG}: routed experts quantised with {name} are not supported; MegaMoE "
        "serves bf16, Quark MXFP4 (A4W4 / A8W4) and DeepSeek V4 fp4 experts"
    )


def expert_format_of(quant_method: object, force_a8w4: bool | None = None, scheme: object = None) -> ExpertFormat:
    """What MegaMoE runs for the layer's quant method under AITER_FORCE_A8W4 (``force_a8w4``; core decides)."""
    declared, scale_param, source = declared_scheme(quant_method, scheme)
    return expert_format(declared, force_a8w4, source, FLAG, scale_param)


__all__ = ["ExpertFormat", "UnsupportedExpertsError", "declared_scheme", "e8m0_bytes", "expert_format_of",
           "expert_weights_from_params"]
