"""MX block formats (OCP microscaling): MXFP8 (e4m3fn) and MXFP4 (e2m1), one E8M0 scale per 1x32.

The torch implementation here is the reference every kernel (Triton, aiter) is checked against,
and it is what the CPU path runs. Layout contract shared with the kernels and the wire:
- ``data`` is uint8. MXFP8: one byte per element (the e4m3fn bit pattern). MXFP4: two elements per
  byte, the EVEN element in the LOW nibble, the odd one in the high nibble.
- ``scales`` is uint8 E8M0, shape ``[..., K // 32]``: block j covers elements 32*j .. 32*j+31.
- scale = amax(block) / max_pos rounded UP to a power of two (max_pos 448 for e4m3, 6 for e2m1),
  so every scaled element is <= max_pos and rounding is round-to-nearest-even onto the grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .e8m0 import decode_e8m0, encode_e8m0, scale_exponent_for_amax

MX_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
MX_FORMATS = ("fp8", "fp4")

# e2m1 magnitudes by 3-bit code; bit 3 is the sign.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive codes, and whether a tie rounds up (to the even code).
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_TIE_UP = (False, True, False, True, False, True, False)


@dataclass(frozen=True)
class MXTensor:
    """A block-quantised tensor: packed ``data`` plus E8M0 ``scales`` along the last dim."""

    data: torch.Tensor  # uint8: [..., K] for fp8, [..., K // 2] for fp4
    scales: torch.Tensor  # uint8: [..., K // 32]
    fmt: str  # "fp8" | "fp4"

    @property
    def logical_k(self) -> int:
        return self.scales.shape[-1] * MX_BLOCK

    def dequantize(self) -> torch.Tensor:
        return dequantize_mx(self)


def max_pos(fmt: str) -> float:
    if fmt == "fp8":
        return FP8_MAX
    if fmt == "fp4":
        return FP4_MAX
    raise ValueError(f"unknown MX format {fmt!r}; expected one of {MX_FORMATS}")


def _check_blockable(x: torch.Tensor, name: str) -> None:
    if x.shape[-1] % MX_BLOCK != 0:
        raise ValueError(
            f"{name}: last dimension {x.shape[-1]} is not a multiple of the MX block ({MX_BLOCK}); "
            "MX quantisation needs whole 1x32 blocks (hidden and intermediate sizes % 32 == 0)"
        )


def fp4_codes(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by their scale, |v| <= 6) to 4-bit e2m1 codes (RNE)."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.int32, device=v.device)
    for mid, tie_up in zip(_FP4_MIDPOINTS, _FP4_TIE_UP):
        code += (mag >= mid if tie_up else mag > mid).to(torch.int32)
    code = torch.where(torch.isnan(v), torch.zeros_like(code), code)
    sign = torch.signbit(v).to(torch.int32) << 3
    return (code | sign).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] 4-bit codes -> [..., K // 2] bytes, even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"fp4 packing needs an even last dimension, got {codes.shape[-1]}")
    lo = codes[..., 0::2].to(torch.int32)
    hi = codes[..., 1::2].to(torch.int32)
    return (lo | (hi << 4)).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K // 2] bytes -> [..., K] 4-bit codes (uint8)."""
    b = packed.to(torch.int32)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(torch.uint8)


def fp4_code_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes -> fp32 values."""
    table = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.to(torch.long)]


def quantize_mx(x: torch.Tensor, fmt: str, name: str = "x") -> MXTensor:
    """Quantise ``x[..., K]`` to MXFP8 / MXFP4 with one E8M0 scale per 1x32 block.

    NaN or Inf anywhere in a block gives that block the NaN scale (0xFF): the damage stays in
    that block of that row.
    """
    top = max_pos(fmt)
    _check_blockable(x, name)
    xf = x.to(torch.float32)
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    invalid = ~torch.isfinite(amax)
    exponent = scale_exponent_for_amax(torch.where(invalid, torch.zeros_like(amax), amax), top)
    scales = encode_e8m0(exponent, invalid)
    scale_values = torch.ldexp(torch.ones_like(amax), exponent.to(torch.float32))
    scaled = (blocks / scale_values.unsqueeze(-1)).reshape(xf.shape)
    if fmt == "fp8":
        data = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        data = pack_fp4(fp4_codes(scaled))
    return MXTensor(data=data, scales=scales, fmt=fmt)


def dequantize_mx(t: MXTensor) -> torch.Tensor:
    """MXTensor -> fp32 values of the logical shape ``[..., K]``."""
    if t.fmt == "fp8":
        values = t.data.view(torch.float8_e4m3fn).to(torch.float32)
    elif t.fmt == "fp4":
        values = fp4_code_values(unpack_fp4(t.data))
    else:
        raise ValueError(f"unknown MX format {t.fmt!r}; expected one of {MX_FORMATS}")
    k = values.shape[-1]
    blocks = values.reshape(*values.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    return (blocks * decode_e8m0(t.scales).unsqueeze(-1)).reshape(values.shape)


def fake_quantize(x: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """Quantise-dequantise round trip in fp32 (fmt None / "bf16": bf16 rounding only)."""
    if fmt in (None, "bf16"):
        return x.to(torch.bfloat16).to(torch.float32)
    return dequantize_mx(quantize_mx(x, fmt))
