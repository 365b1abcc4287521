"""vLLM's routed-experts quant method -> the checkpoint's declared scheme; loaded tensors -> ``ExpertWeights``.

Why convert *after* vLLM loaded them: vLLM's own quant method creates the parameters and its
weight loaders fill them from every checkpoint layout it knows (per-expert ``gate_proj/up_proj/
down_proj``, fused ``gate_up_proj``, DeepSeek V4 ``w1/w3/w2``, EPLB replicas, TP/EP slicing). After
loading, the layout is the one core maps (``megamoe_backend.experts.loaded``): ``w13_weight`` /
``w2_weight`` (+ ``*_weight_scale`` E8M0 for MXFP4; + ``*_weight_scale_inv`` fp32 per 128x128 block for
``Fp8MoEMethod``'s block-FP8, DeepSeek V3 / R1 FP8, whose w13 holds [w1 (gate); w3 (up)] rows as vLLM's
loader fills shard ids w1 then w3). This module only reads vLLM's quant-method
classes -- the scheme the checkpoint declares and, where vLLM's quant method names it, the
activation format vLLM itself runs (the engine's reading: ``Mxfp4MoEMethod.activation_key``); which
scheme and dispatch wire then run (the reading, ``AITER_FORCE_A8W4``, ``MEGA_DISPATCH_WIRE``) is core's
decision (``spec.choose_scheme``), shared with ``megamoe info`` and the SGLang plugin.
"""

from __future__ import annotations

import torch

from megamoe_backend.experts import ExpertWeights
from megamoe_backend.experts.loaded import ExpertFormat, UnsupportedExpertsError, expert_format
from megamoe_backend.experts.loaded import expert_weights_from_params as _from_params
from megamoe_backend.formats.block_fp8 import BlockFP8Error, check_weight_block_size
from megamoe_backend.knobs import Knobs
from megamoe_backend.spec import EngineReading, SchemeChoice, choose_scheme

FLAG = "--moe-backend megamoe_ep"
# Quark OCP-MX scheme -> the scheme the checkpoint declares.
_QUARK_SCHEMES = {"w_mxfp4_a_mxfp4": "a4w4", "w_mxfp4_a_fp8": "a8w4"}


def declared_scheme(quant_method: object) -> str:
    """The scheme vLLM's routed-experts quant method loads; raise for anything MegaMoE cannot serve.

    ``Mxfp4MoEMethod`` (DeepSeek V4 ``expert_dtype=fp4`` checkpoints, ``quant_method: mxfp4``) loads
    MXFP4 weights without activation scales: A4W4, as upstream MegaMoE runs it. The activation format
    vLLM's method itself names (``activation_key``, vLLM 0.33+ for DeepSeek V4) is ``engine_reading``'s.
    """
    name = type(quant_method).__name__
    if name == "MXFP4ExpertParams":
        return quant_method.quant
    if name == "UnquantizedFusedMoEMethod":
        return "bf16"
    if name == "Fp8MoEMethod":  # DeepSeek V3 / R1 FP8: 128 x 128 blocks only (per-tensor, other blocks refused)
        check_block_fp8_method(quant_method)
        return "fp8_block"
    if name == "Mxfp4MoEMethod":
        if getattr(quant_method, "weight_dtype", "mxfp4") != "mxfp4":
            raise UnsupportedExpertsError(f"{FLAG}: {name} with weights {quant_method.weight_dtype!r}")
        return "a4w4"
    if name == "QuarkOCP_MX_MoEMethod":
        scheme = getattr(quant_method, "ocp_mx_scheme", None)
        if getattr(quant_method, "weight_dtype", None) == "mxfp4" and scheme in _QUARK_SCHEMES:
            return _QUARK_SCHEMES[scheme]
        raise UnsupportedExpertsError(
            f"{FLAG}: Quark OCP-MX scheme {scheme!r} is not supported; MegaMoE serves "
            f"MXFP4 weights with MXFP4 (A4W4) or FP8 (A8W4) activations"
        )
    raise UnsupportedExpertsError(
        f"{FLAG}: routed experts quantised with {name} are not supported; MegaMoE serves "
        "bf16 checkpoints, block-FP8 (DeepSeek V3 / R1 FP8, weight_block_size [128, 128]) and MXFP4 (Quark A4W4 / "
        "A8W4, DeepSeek V4 fp4 experts). Serve this model with vLLM's default MoE backend."
    )


def check_block_fp8_method(quant_method: object) -> None:
    """vLLM's ``Fp8MoEMethod`` must hold the checkpoint's 128 x 128 block scales, as loaded: refuse (naming
    ``weight_block_size``) per-tensor scales, another block size, or scales vLLM re-gridded for a TP shard
    (``weight_scale_refine``; MegaMoE splits experts over EP, so a shard never cuts a block)."""
    try:
        check_weight_block_size(getattr(quant_method, "weight_block_size", None), f"{FLAG}: vLLM's Fp8MoEMethod")
    except BlockFP8Error as exc:
        raise UnsupportedExpertsError(str(exc)) from None
    refine = getattr(quant_method, "weight_scale_refine", None)
    if refine is not None:
        raise UnsupportedExpertsError(
            f"{FLAG}: vLLM's Fp8MoEMethod refined the block scales by {tuple(refine)} for a tensor-parallel shard "
            f"(block {getattr(quant_method, 'moe_block_shape', '?')}); MegaMoE reads the checkpoint's [128, 128] "
            "blocks: serve with --enable-expert-parallel, which keeps whole experts on each rank")


def _activation_key_names() -> list[tuple[object, str, str]]:
    """(vLLM's QuantKey, its name, the scheme it makes MXFP4 weights): the activation keys MegaMoE runs."""
    from vllm.model_executor.layers.quantization.utils import quant_utils

    return [(quant_utils.kMxfp8Dynamic, "kMxfp8Dynamic", "a8w4"), (quant_utils.kMxfp4Dynamic, "kMxfp4Dynamic", "a4w4")]


def engine_reading(quant_method: object) -> EngineReading | None:
    """The activation format vLLM's MXFP4 quant method names (``activation_key``: "checkpoint-declared
    activation quantization", set by vLLM 0.33+'s DeepSeek V4 config), or None where it names none."""
    name = type(quant_method).__name__
    key = getattr(quant_method, "activation_key", None) if name in ("Mxfp4MoEMethod", "MXFP4ExpertParams") else None
    if key is None:
        return None
    import vllm

    for known, key_name, scheme in _activation_key_names():
        if key == known:
            return EngineReading(scheme, f"vLLM {vllm.__version__} Mxfp4MoEMethod(activation_key={key_name})")
    raise UnsupportedExpertsError(
        f"{FLAG}: vLLM's {name} declares activations {key} for these MXFP4 experts; MegaMoE runs MXFP4 weights "
        "with MXFP8 (A8W4) or MXFP4 (A4W4) activations. Serve this model with vLLM's default MoE backend."
    )


def scheme_choice_of(quant_method: object, knobs: Knobs) -> SchemeChoice:
    """The scheme and dispatch wire MegaMoE runs for vLLM's quant method under the knobs (core decides)."""
    return choose_scheme(declared_scheme(quant_method), engine_reading(quant_method), knobs, FLAG)


def expert_format_of(quant_method: object, knobs: Knobs) -> ExpertFormat:
    """What MegaMoE runs for vLLM's quant method under the knobs (``scheme_choice_of``), as an ExpertFormat."""
    name = type(quant_method).__name__
    choice = scheme_choice_of(quant_method, knobs)  # refuses first: what follows reads a served method
    scheme = getattr(quant_method, "quant", None) or getattr(quant_method, "ocp_mx_scheme", None)
    if name == "Fp8MoEMethod":
        scheme = f"weight_block_size={list(quant_method.weight_block_size)}"
    source = f"{name}({scheme})" if scheme else name
    return expert_format(choice, source, "_scale_inv" if choice.quant == "fp8_block" else "_scale")


def expert_weights_from_params(params: dict[str, torch.Tensor], fmt: ExpertFormat) -> ExpertWeights:
    """Interleaved ``ExpertWeights`` from a layer's loaded tensors (vLLM adds no padding rows)."""
    return _from_params(params, fmt)


__all__ = ["ExpertFormat", "UnsupportedExpertsError", "check_block_fp8_method", "declared_scheme", "engine_reading", "expert_format_of",
           "expert_weights_from_params", "scheme_choice_of"]
