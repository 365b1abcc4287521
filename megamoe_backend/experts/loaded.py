"""Routed-expert parameters an engine loaded -> MegaMoE ``ExpertWeights``; what they run as.

Why in core: vLLM and SGLang build different quant-method objects, but after loading both hold
the same tensors -- ``w13_weight`` [E, 2I(+pad), H] (bf16) or [E, 2I(+pad), H/2] uint8 e2m1 pairs
(even element in the low nibble) with one E8M0 scale per 1x32 block in ``w13_weight<suffix>``
[E, 2I(+pad), H/32], and ``w2_*`` [E, H, I(+pad)(/2)] -- so the conversion, and the decision of
which scheme runs (``spec.choose_scheme``), is written once here. A plugin only names what
its engine's quant method declares (``expert_format``) and where the scales live.

MegaMoE kernels take gate/up row-interleaved (``[g0, u0, g1, u1, ...]``); the row permutation is
applied to data and scales alike, which is exact. Float32 E8M0 scales (SGLang on CUDA) are
converted exactly: a scale that is not a power of two is an error, never rounded.

Block-FP8 experts (DeepSeek V3 / R1 FP8: ``w13_weight`` [E, 2I, H] e4m3 with ``w13_weight_scale_inv``
[E, 2I/128, H/128] fp32, ``w2_*`` likewise) keep the plain ``[gate; up]`` rows: one scale covers a
128-row block of gate rows or of up rows, which interleaving would split (experts/weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import MX_BLOCK
from ..formats.block_fp8 import FP8_BLOCK
from ..spec.expert_scheme import WEIGHTS_OF_SCHEME, SchemeChoice, UnsupportedExpertsError
from .weights import ExpertWeights, interleave_gate_up


@dataclass(frozen=True)
class ExpertFormat:
    """What an engine's quant method loaded, and the scheme MegaMoE runs it as."""

    quant: str  # scheme that runs: "bf16" | "fp8_block" | "a8w4" | "a4w4" (after AITER_FORCE_A8W4)
    weights: str  # ExpertWeights.fmt: "bf16" | "fp8_block" | "mxfp4"
    source: str  # the engine's quant method, for messages and the startup note
    scale_param: str = "_scale"  # parameter-name suffix of the scales ("_scale", "_scale_inv")
    declared: str = ""  # the checkpoint's own scheme, before the knob ("" = same as quant)


def expert_format(choice: SchemeChoice, source: str, scale_param: str = "_scale") -> ExpertFormat:
    """The one classification both plugins end in: ``spec.choose_scheme``'s choice -> ExpertFormat."""
    unchanged = choice.quant == choice.declared and choice.reading is None
    label = source if unchanged else f"{source}: {choice.describe()}"
    return ExpertFormat(choice.quant, WEIGHTS_OF_SCHEME[choice.quant], label, scale_param, choice.declared)


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
    params: dict[str, torch.Tensor], fmt: ExpertFormat, intermediate: int | None = None, up_first: bool = False
) -> ExpertWeights:
    """Build interleaved ``ExpertWeights`` from one layer's loaded tensors (by engine parameter name).

    ``intermediate`` is the true per-partition intermediate size; zero padding an engine added for
    its own kernels (rows past it in w13, columns past it in w2) is dropped. None: no padding (half
    of w13's rows). ``up_first``: the engine loaded up_proj into the first half of w13.
    """
    try:
        w13, w2 = params["w13_weight"], params["w2_weight"]
    except KeyError as exc:
        raise UnsupportedExpertsError(f"routed experts have no parameter {exc.args[0]!r}") from None
    inter = intermediate if intermediate is not None else w13.shape[1] // 2
    if fmt.weights == "bf16":
        if not w13.is_floating_point():
            raise UnsupportedExpertsError(f"w13_weight is {w13.dtype}; bf16 experts need a float dtype")
        w13 = _plain_gate_up(w13, inter, up_first)
        return ExpertWeights(
            interleave_gate_up(w13.to(torch.bfloat16)).contiguous(),
            w2[..., :inter].to(torch.bfloat16).contiguous(),
            "bf16",
            "interleaved",
        )
    s13_name, s2_name = f"w13_weight{fmt.scale_param}", f"w2_weight{fmt.scale_param}"
    s13, s2 = params.get(s13_name), params.get(s2_name)
    if fmt.weights == "fp8_block":
        return _block_fp8_weights(w13, w2, s13, s2, (s13_name, s2_name), inter, up_first)
    if s13 is None or s2 is None:
        raise UnsupportedExpertsError(f"MXFP4 routed experts need {s13_name} and {s2_name}")
    if inter % MX_BLOCK:
        raise UnsupportedExpertsError(f"MXFP4 experts need intermediate % {MX_BLOCK} == 0, got {inter}")
    w13 = _plain_gate_up(w13.view(torch.uint8), inter, up_first)
    s13 = _plain_gate_up(e8m0_bytes(s13, s13_name), inter, up_first)
    return ExpertWeights(
        interleave_gate_up(w13).contiguous(),
        w2.view(torch.uint8)[..., : inter // 2].contiguous(),
        "mxfp4",
        "interleaved",
        interleave_gate_up(s13).contiguous(),
        e8m0_bytes(s2, s2_name)[..., : inter // MX_BLOCK].contiguous(),
    )


def _block_fp8_weights(w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor | None, s2: torch.Tensor | None,
                       names: tuple[str, str], inter: int, up_first: bool) -> ExpertWeights:
    """Block-FP8 parameters -> ``ExpertWeights(fmt="fp8_block")``, plain [gate; up] rows (no interleave).

    Padding rows (an engine's intermediate past ``inter``) are dropped in whole 128-blocks only: the
    scale rows follow the weight rows 128 to one. Shapes, dtypes and one scale per block are checked by
    ExpertWeights, naming the tensor (per-tensor scales: "a checkpoint without weight_block_size").
    """
    for name, s in zip(names, (s13, s2)):
        if s is None:
            raise UnsupportedExpertsError(f"block-FP8 routed experts need {name} (one fp32 scale per 128x128 block); "
                                          "the engine loaded none")
    block = FP8_BLOCK
    if inter % block or (w13.shape[1] // 2) % block:
        raise UnsupportedExpertsError(f"block-FP8 routed experts need an intermediate size that is a multiple of {block} "
                                      f"(whole 128x128 blocks), got {inter} ({w13.shape[1] // 2} rows loaded per half)")
    w13 = _plain_gate_up(w13.view(torch.float8_e4m3fn), inter, up_first)
    if s13.dim() == 3:  # the scale rows follow the weight rows, one per 128 (anything else: ExpertWeights names it)
        s13 = _plain_gate_up(s13, inter // block, up_first)
    if s2.dim() == 3:
        s2 = s2[..., : inter // block]
    try:
        return ExpertWeights(
            w13.contiguous(), w2.view(torch.float8_e4m3fn)[..., :inter].contiguous(), "fp8_block", "plain",
            s13.contiguous(), s2.contiguous(),
        )
    except ValueError as exc:
        raise UnsupportedExpertsError(f"block-FP8 routed experts ({names[0]} / {names[1]} as loaded; w1 = w13): {exc}") from None


__all__ = ["ExpertFormat", "UnsupportedExpertsError", "e8m0_bytes", "expert_format", "expert_weights_from_params"]
