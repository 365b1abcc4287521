"""The expert quant scheme that runs: what the checkpoint declares x the operator's AITER_FORCE_A8W4.

Why one function: `megamoe info` learns what a checkpoint declares from its config.json, the vLLM
and SGLang plugins from the quant-method objects their engines built, but what then runs must be
one answer everywhere. aiter and ATOM read ``AITER_FORCE_A8W4=1`` as the operator's choice of the A
operand for MXFP4 weights, so MXFP4 experts (Quark A4W4 or A8W4, DeepSeek V4 ``expert_dtype: fp4``)
run A8W4 under it -- and ``MEGA_DISPATCH_WIRE=fp8`` is then the matching quantised wire -- on every
platform. Unset or 0 keeps the checkpoint's own scheme (V4 fp4 experts declare no activation
format: A4W4, as upstream MegaMoE runs them). The knob does not touch bf16 experts.
"""

from __future__ import annotations

from .moe_spec import QUANT_SCHEMES

# What the experts' weights are stored as, per scheme that runs (ExpertWeights.fmt).
WEIGHTS_OF_SCHEME = {"bf16": "bf16", "a8w4": "mxfp4", "a4w4": "mxfp4"}
MXFP4_SCHEMES = ("a4w4", "a8w4")


class UnsupportedExpertsError(ValueError):
    """The routed experts use a format MegaMoE cannot serve (named in the message)."""


def expert_quant_scheme(declared: str, force_a8w4: bool | None, where: str = "megamoe") -> str:
    """The scheme the experts run: ``declared`` (bf16 | fp8_block | a8w4 | a4w4) under AITER_FORCE_A8W4.

    ``where`` names the caller in errors (a serving flag, or ``megamoe info``). Block-FP8 experts
    are refused here, for every caller alike: no MegaMoE provider behind the engines computes them.
    """
    if declared not in QUANT_SCHEMES:
        raise UnsupportedExpertsError(f"{where}: expert quant scheme {declared!r}; expected one of {QUANT_SCHEMES}")
    if declared == "fp8_block":
        raise UnsupportedExpertsError(
            f"{where}: block-FP8 routed experts (DeepSeek V3/R1 FP8 checkpoints) are not served by MegaMoE's "
            "CPU/Triton/aiter providers; use the bf16 or Quark MXFP4 checkpoint, or the engine's own FP8 MoE backend"
        )
    if force_a8w4 and declared in MXFP4_SCHEMES:
        return "a8w4"
    return declared


def describe_scheme(declared: str, running: str) -> str:
    """``a8w4 (checkpoint a4w4, AITER_FORCE_A8W4=1)`` when the knob changed it, else the scheme."""
    return running if running == declared else f"{running} (checkpoint {declared}, AITER_FORCE_A8W4=1)"


__all__ = ["MXFP4_SCHEMES", "WEIGHTS_OF_SCHEME", "UnsupportedExpertsError", "describe_scheme", "expert_quant_scheme"]
