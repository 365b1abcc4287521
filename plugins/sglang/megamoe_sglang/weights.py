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

MegaMoE kernels take gate/up row-interleaved (``[g0, u0, g1, u1, ...]``); the row permutation is
applied to data and scales alike, which is exact. Float32 E8M0 scales are converted exactly (a
scale that is not a power of two is an error, never rounded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe_backend.experts import ExpertWeights, interleave_gate_up
from megamoe_backend.formats import MX_BLOCK

_QUARK_SCHEMES = {"QuarkW4A4MXFp4MoE": "a4w4", "QuarkW4A8MXFp4MoE": "a8w4"}


class UnsupportedExpertsError(ValueError):
    """The layer's routed experts use a format MegaMoE cannot serve (named in the message)."""


@dataclass(frozen=True)
class ExpertFormat:
    """What SGLang's quant method loaded, as MegaMoE sees it."""

    quant: str  # MegaMoE quant scheme: "bf16" | "a8w4" | "a4w4"
    weights: str  # ExpertWeights.fmt: "bf16" | "mxfp4"
    scale_param: str | None  # parameter-name suffix of the scales ("_scale", "_scale_inv")
    source: str  # SGLang's quant method / scheme, for messages


def expert_format_of(quant_method: object, force_a8w4: bool | None = None, scheme: object = None) -> ExpertFormat:
    """Classify the layer's quant method; raise for anything MegaMoE cannot serve.

    ``QuarkFusedMoEMethod`` delegates to a scheme object (SGLang keeps it on the layer,
    ``layer.scheme``; pass it as ``scheme``) whose class names the activation format. DeepSeek V4 fp4 experts declare no activation format: A4W4 as upstream
    MegaMoE, A8W4 when the operator sets AITER_FORCE_A8W4=1 (``force_a8w4``).
    """
    name = type(quant_method).__name__
    if name == "UnquantizedFusedMoEMethod":
        return ExpertFormat("bf16", "bf16", None, name)
    if name == "QuarkFusedMoEMethod":
        scheme = type(scheme if scheme is not None else getattr(quant_method, "scheme", None)).__name__
        if scheme in _QUARK_SCHEMES:
            return ExpertFormat(_QUARK_SCHEMES[scheme], "mxfp4", "_scale", f"{name}({scheme})")
        raise UnsupportedExpertsError(
            f"--moe-a2a-backend megamoe_ep: Quark MoE scheme {scheme} is not supported; MegaMoE serves "
            "MXFP4 weights with MXFP4 (A4W4) or FP8 (A8W4) activations"
        )
    if name == "Fp8MoEMethod":
        if getattr(quant_method, "is_fp4_expert", False):
            return ExpertFormat("a8w4" if force_a8w4 else "a4w4", "mxfp4", "_scale_inv", f"{name}(fp4 experts)")
        raise UnsupportedExpertsError(
            "--moe-a2a-backend megamoe_ep: block-FP8 routed experts (DeepSeek V3/R1 FP8 checkpoints) are "
            "not served by MegaMoE's CPU/Triton/aiter providers; use the bf16 or Quark MXFP4 checkpoint, "
            "or SGLang's in-tree --moe-a2a-backend megamoe / deepep for FP8"
        )
    raise UnsupportedExpertsError(
        f"--moe-a2a-backend megamoe_ep: routed experts quantised with {name} are not supported; MegaMoE "
        "serves bf16, Quark MXFP4 (A4W4 / A8W4) and DeepSeek V4 fp4 experts"
    )


def e8m0_bytes(scales: torch.Tensor, name: str) -> torch.Tensor:
    """Scales as E8M0 bytes: uint8 / float8_e8m0fnu are reinterpreted, float32 powers of two converted."""
    if scales.dtype == torch.uint8:
        return scales
    if getattr(torch, "float8_e8m0fnu", None) is not None and scales.dtype == torch.float8_e8m0fnu:
        return scales.view(torch.uint8)
    if scales.dtype in (torch.float32, torch.bfloat16, torch.float16):
        s = scales.to(torch.float32)
        if bool((s <= 0).any()) or not bool(torch.isfinite(s).all()):
            raise UnsupportedExpertsError(f"{name}: E8M0 scales must be positive finite powers of two")
        mantissa, exponent = torch.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
        if not bool((mantissa == 0.5).all()):
            raise UnsupportedExpertsError(f"{name}: float scales are not all powers of two (not E8M0)")
        biased = exponent.to(torch.int32) - 1 + 127
        if bool((biased < 0).any()) or bool((biased > 254).any()):
            raise UnsupportedExpertsError(f"{name}: scale exponent outside the E8M0 range")
        return biased.to(torch.uint8)
    raise UnsupportedExpertsError(f"{name}: scale dtype {scales.dtype} is not an E8M0 encoding")


def _plain_gate_up(t: torch.Tensor, inter: int, up_first: bool) -> torch.Tensor:
    """[E, 2*Ip, K], two halves of Ip rows (gate then up, or up then gate when ``up_first``) ->
    [E, 2*I, K] gate-then-up without the pad rows past ``inter`` in each half."""
    padded = t.shape[1] // 2
    first, second = t[:, :inter], t[:, padded:padded + inter]
    if up_first:
        first, second = second, first
    if padded == inter and not up_first:
        return t
    return torch.cat((first, second), dim=1)


def expert_weights_from_params(
    params: dict[str, torch.Tensor], fmt: ExpertFormat, intermediate: int, up_first: bool = False
) -> ExpertWeights:
    """Build interleaved ``ExpertWeights`` from one layer's loaded tensors (by SGLang parameter name).

    ``intermediate`` is the true per-partition intermediate size; any zero padding SGLang added
    for its own kernels (rows past it in w13, packed columns past it in w2) is dropped.
    ``up_first``: the quant method loads up_proj into the first half (its
    ``load_up_proj_weight_first``, TRT-LLM layouts); SGLang's default is gate first.
    """
    try:
        w13, w2 = params["w13_weight"], params["w2_weight"]
    except KeyError as exc:
        raise UnsupportedExpertsError(f"routed experts have no parameter {exc.args[0]!r}") from None
    if fmt.weights == "bf16":
        if not w13.is_floating_point():
            raise UnsupportedExpertsError(f"w13_weight is {w13.dtype}; bf16 experts need a float dtype")
        w13 = _plain_gate_up(w13, intermediate, up_first)
        return ExpertWeights(
            interleave_gate_up(w13.to(torch.bfloat16)).contiguous(),
            w2[..., :intermediate].to(torch.bfloat16).contiguous(),
            "bf16",
            "interleaved",
        )
    s13_name, s2_name = f"w13_weight{fmt.scale_param}", f"w2_weight{fmt.scale_param}"
    s13, s2 = params.get(s13_name), params.get(s2_name)
    if s13 is None or s2 is None:
        raise UnsupportedExpertsError(f"MXFP4 routed experts need {s13_name} and {s2_name}")
    if intermediate % MX_BLOCK:
        raise UnsupportedExpertsError(f"MXFP4 experts need intermediate % {MX_BLOCK} == 0, got {intermediate}")
    w13 = _plain_gate_up(w13.view(torch.uint8), intermediate, up_first)
    s13 = _plain_gate_up(e8m0_bytes(s13, s13_name), intermediate, up_first)
    return ExpertWeights(
        interleave_gate_up(w13).contiguous(),
        w2.view(torch.uint8)[..., : intermediate // 2].contiguous(),
        "mxfp4",
        "interleaved",
        interleave_gate_up(s13).contiguous(),
        e8m0_bytes(s2, s2_name)[..., : intermediate // MX_BLOCK].contiguous(),
    )


__all__ = ["ExpertFormat", "UnsupportedExpertsError", "e8m0_bytes", "expert_format_of", "expert_weights_from_params"]
