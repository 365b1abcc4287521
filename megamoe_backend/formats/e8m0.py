"""E8M0 block scales: one unsigned byte holding a power-of-two exponent (bias 127).

Why a separate module: the scale rule ("amax / max_pos rounded UP to a power of two") is the
one place where MXFP4 and MXFP8 must agree bit for bit with the Triton / aiter kernels, so it is
written once here and everything else calls it.

Encoding: byte b in 0..254 means 2**(b - 127); 255 (0xFF) means NaN. A block whose amax is
NaN or Inf gets the NaN scale, so the whole block (and only that block of that row) dequantises
to NaN instead of spreading garbage to other tokens.
"""

from __future__ import annotations

import torch

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127


def scale_exponent_for_amax(amax: torch.Tensor, max_pos: float) -> torch.Tensor:
    """Smallest integer e with 2**e >= amax / max_pos, clamped to the E8M0 range.

    Computed with frexp on the fp32 quotient so that no floating log2 rounding can land
    one exponent off: r = m * 2**k with m in [0.5, 1); r is an exact power of two iff m == 0.5,
    in which case e = k - 1, otherwise e = k. amax == 0 gives the smallest exponent (-127).
    """
    ratio = amax.to(torch.float32) / max_pos
    mantissa, exponent = torch.frexp(ratio)
    exponent = exponent.to(torch.int32)
    e = torch.where(mantissa == 0.5, exponent - 1, exponent)
    e = torch.where(ratio == 0, torch.full_like(e, E8M0_MIN_EXP), e)
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def encode_e8m0(exponent: torch.Tensor, invalid: torch.Tensor | None = None) -> torch.Tensor:
    """Integer exponents -> E8M0 bytes (uint8); ``invalid`` positions become 0xFF (NaN)."""
    byte = (exponent + E8M0_BIAS).to(torch.int32)
    if invalid is not None:
        byte = torch.where(invalid, torch.full_like(byte, E8M0_NAN), byte)
    return byte.to(torch.uint8)


def decode_e8m0(scale_bytes: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 scale values (2**(b-127); NaN for 0xFF).

    ldexp keeps 2**-127 exact (an fp32 subnormal) instead of going through pow/exp.
    """
    b = scale_bytes.to(torch.int32)
    value = torch.ldexp(torch.ones_like(b, dtype=torch.float32), (b - E8M0_BIAS).to(torch.float32))
    return torch.where(b == E8M0_NAN, torch.full_like(value, float("nan")), value)
