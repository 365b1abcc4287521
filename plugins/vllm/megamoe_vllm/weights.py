"""vLLM's loaded routed-expert parameters -> MegaMoE ``ExpertWeights``.

Why convert *after* vLLM loaded them: vLLM's own quant method creates the parameters and its
weight loaders fill them from every checkpoint layout it knows (per-expert ``gate_proj/up_proj/
down_proj``, fused ``gate_up_proj``, DeepSeek V4 ``w1/w3/w2``, EPLB replicas, TP/EP slicing). After
loading, the layout is the same for all of them — that is the one mapping kept here:

- unquantized: ``w13_weight`` [E, 2I, H] (rows: gate then up), ``w2_weight`` [E, H, I];
- MXFP4 (Quark OCP-MX, DeepSeek V4 / gpt-oss style ``mxfp4``): ``w13_weight`` [E, 2I, H/2] uint8
  (e2m1 pairs, even element in the low nibble), ``w13_weight_scale`` [E, 2I, H/32] uint8 E8M0,
  ``w2_weight`` [E, H, I/2], ``w2_weight_scale`` [E, H, I/32].

MegaMoE kernels take gate/up row-interleaved (``[g0, u0, g1, u1, ...]``); the row permutation is
applied to data and scales alike, which is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe_backend.experts import ExpertWeights, interleave_gate_up
from megamoe_backend.knobs import Knobs

# (vLLM quant method class name, OCP-MX scheme or None) -> MegaMoE quant scheme.
_QUARK_SCHEMES = {"w_mxfp4_a_mxfp4": "a4w4", "w_mxfp4_a_fp8": "a8w4"}


class UnsupportedExpertsError(ValueError):
    """The model's routed experts use a format MegaMoE cannot serve (named in the message)."""


@dataclass(frozen=True)
class ExpertFormat:
    """What the vLLM quant method loaded, as MegaMoE sees it."""

    quant: str  # MegaMoE quant scheme: "bf16" | "a8w4" | "a4w4"
    weights: str  # ExpertWeights.fmt: "bf16" | "mxfp4"
    source: str  # the vLLM quant method, for messages and the startup note


def expert_format_of(quant_method: object, knobs: Knobs) -> ExpertFormat:
    """Classify vLLM's routed-experts quant method; raise for anything MegaMoE cannot serve.

    ``Mxfp4MoEMethod`` (DeepSeek V4 ``expert_dtype=fp4`` checkpoints, ``quant_method: mxfp4``)
    declares no activation format; MegaMoE runs it as A4W4 like upstream, or A8W4 when the
    operator sets AITER_FORCE_A8W4=1.
    """
    name = type(quant_method).__name__
    if name == "MXFP4ExpertParams":
        return ExpertFormat(quant_method.quant, "mxfp4", f"{name}({quant_method.quant})")
    if name == "UnquantizedFusedMoEMethod":
        return ExpertFormat("bf16", "bf16", name)
    if name == "Mxfp4MoEMethod":
        if getattr(quant_method, "weight_dtype", "mxfp4") != "mxfp4":
            raise UnsupportedExpertsError(f"--moe-backend megamoe_ep: {name} with weights {quant_method.weight_dtype!r}")
        return ExpertFormat("a8w4" if knobs.aiter_force_a8w4 else "a4w4", "mxfp4", name)
    if name == "QuarkOCP_MX_MoEMethod":
        scheme = getattr(quant_method, "ocp_mx_scheme", None)
        if getattr(quant_method, "weight_dtype", None) == "mxfp4" and scheme in _QUARK_SCHEMES:
            return ExpertFormat(_QUARK_SCHEMES[scheme], "mxfp4", f"{name}({scheme})")
        raise UnsupportedExpertsError(
            f"--moe-backend megamoe_ep: Quark OCP-MX scheme {scheme!r} is not supported; MegaMoE serves "
            f"MXFP4 weights with MXFP4 (A4W4) or FP8 (A8W4) activations"
        )
    raise UnsupportedExpertsError(
        f"--moe-backend megamoe_ep: routed experts quantised with {name} are not supported; MegaMoE serves "
        "bf16 checkpoints and Quark MXFP4 (A4W4 / A8W4). Serve this model with vLLM's default MoE backend."
    )


def expert_weights_from_params(params: dict[str, torch.Tensor], fmt: ExpertFormat) -> ExpertWeights:
    """Build interleaved ``ExpertWeights`` from a layer's loaded tensors (by vLLM parameter name)."""
    try:
        w13, w2 = params["w13_weight"], params["w2_weight"]
    except KeyError as exc:
        raise UnsupportedExpertsError(f"routed experts have no parameter {exc.args[0]!r}") from None
    if fmt.weights == "bf16":
        if not w13.is_floating_point():
            raise UnsupportedExpertsError(f"w13_weight is {w13.dtype}; bf16 experts need a float dtype")
        return ExpertWeights(
            interleave_gate_up(w13.to(torch.bfloat16)).contiguous(),
            w2.to(torch.bfloat16).contiguous(),
            "bf16",
            "interleaved",
        )
    s13, s2 = params.get("w13_weight_scale"), params.get("w2_weight_scale")
    if s13 is None or s2 is None:
        raise UnsupportedExpertsError("MXFP4 routed experts need w13_weight_scale and w2_weight_scale")
    return ExpertWeights(
        interleave_gate_up(w13.view(torch.uint8)).contiguous(),
        w2.view(torch.uint8).contiguous(),
        "mxfp4",
        "interleaved",
        interleave_gate_up(s13.view(torch.uint8)).contiguous(),
        s2.view(torch.uint8).contiguous(),
    )
