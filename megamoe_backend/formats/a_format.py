"""The A operand's formats by name, one dispatch: MX "fp8" / "fp4" (formats/mx.py) or block-FP8 "fp8_g128"
(formats/block_fp8.py).

Why here: the experts' reference (and anything else emulating the A operand) asks by the name in
``spec.moe_spec.A_OPERAND``; an unknown name is an error, never a silent bf16 rounding.
"""

from __future__ import annotations

import torch

from .block_fp8 import A_FORMAT as FP8_G128
from .block_fp8 import GroupFP8Tensor, dequantize_groups, fake_quantize_groups
from .mx import MX_FORMATS, MXTensor, dequantize_mx, fake_quantize

A_FORMATS = (*MX_FORMATS, FP8_G128)


def fake_quantize_a(x: torch.Tensor, a_format: str | None) -> torch.Tensor:
    """Quantise-dequantise ``x`` into ``a_format`` in fp32 (None / "bf16": bf16 rounding only)."""
    if a_format == FP8_G128:
        return fake_quantize_groups(x.to(torch.float32))
    if a_format not in (None, "bf16", *MX_FORMATS):
        raise ValueError(f"unknown A format {a_format!r}; expected one of {A_FORMATS} or bf16")
    return fake_quantize(x, a_format)


def dequantize_a(t: MXTensor | GroupFP8Tensor) -> torch.Tensor:
    """Quantised rows as they arrived (MX or 1x128 groups) -> fp32."""
    return dequantize_groups(t) if isinstance(t, GroupFP8Tensor) else dequantize_mx(t)
