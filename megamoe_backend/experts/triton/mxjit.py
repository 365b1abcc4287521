"""Element-level MX helpers shared by the Triton kernels (all ``@triton.jit``, inlined).

Why hand-written bit arithmetic instead of ``x.to(tl.float8e4nv)`` and friends: the results must be
bit-identical to megamoe_backend.formats (torch) on every backend, and the Triton interpreter's fp8
cast rounds ties away from even and does not saturate like torch does. Integer code paths give the
same bytes in the interpreter and on the GPU.

Conventions (see formats/mx.py): E8M0 byte b means 2**(b-127), 0xFF is NaN; e4m3fn encode is
round-to-nearest-even with saturation to +-448 (torch's rule), NaN -> 0x7F | sign; e2m1 encode counts
midpoints exactly like ``formats.mx.fp4_codes``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# (mantissa limit of the max value in fp32 bits, its binary exponent): 6 = 1.5 * 2**2, 448 = 1.75 * 2**8
FP4_MANT_LIMIT = tl.constexpr(0x400000)
FP4_MAX_EXP = tl.constexpr(2)
FP8_MANT_LIMIT = tl.constexpr(0x600000)
FP8_MAX_EXP = tl.constexpr(8)


@triton.jit
def pow2(e):
    """2**e as fp32 for int32 e in [-127, 127] (2**-127 is the one subnormal)."""
    normal = ((e + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, 5.877471754111438e-39)


@triton.jit
def scale_exponent(amax, MANT_LIMIT: tl.constexpr, MAX_EXP: tl.constexpr):
    """Smallest e with fl(amax / max_pos) <= 2**e, clamped to [-127, 127] (amax finite, >= 0).

    With max_pos = c * 2**MAX_EXP and amax = M * 2**ea: e = ea - MAX_EXP + (M > c). The one place
    fp32 division rounds differently is where the ratio is the subnormal 2**-127 boundary (ratio
    rounds down to it for mantissa LIMIT + 1), reproduced so that fp32 inputs match torch exactly.
    """
    bits = amax.to(tl.int32, bitcast=True)
    ea = ((bits >> 23) & 0xFF) - 127
    mant = bits & 0x7FFFFF
    limit = tl.where(ea == MAX_EXP - 127, MANT_LIMIT + 1, MANT_LIMIT)
    e = ea - MAX_EXP + (mant > limit).to(tl.int32)
    e = tl.where(((bits >> 23) & 0xFF) == 0, -127, e)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def nonfinite(x):
    """1 where x is NaN or +-Inf (int32), robust to max() dropping NaNs."""
    return ((x.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000).to(tl.int32)


@triton.jit
def encode_e4m3(v):
    """fp32 -> e4m3fn byte (uint8): RNE, saturate to 448, NaN -> 0x7F | sign."""
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    abits = bits & 0x7FFFFFFF
    a = abits.to(tl.float32, bitcast=True)
    # subnormal range (< 2**-6): round a * 2**9 to an integer code 0..8 (8 is the first normal)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    exp = (abits >> 23) - 127
    keep = (abits & 0x7FFFFF) >> 20
    rem = abits & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((keep & 1) == 1))
    nrm = ((exp + 7) << 3) + keep + up.to(tl.int32)
    code = tl.where(a < 0.015625, sub, nrm)
    code = tl.minimum(code, 126)
    code = tl.where(abits > 0x7F800000, 127, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def encode_e2m1(v):
    """fp32 (already divided by the block scale) -> 4-bit e2m1 code in an int32 (RNE by midpoints)."""
    bits = v.to(tl.int32, bitcast=True)
    mag = tl.abs(v)
    code = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
    code += (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
    code += (mag > 5.0).to(tl.int32)
    code = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0, code)
    return code | (((bits >> 31) & 1) << 3)


@triton.jit
def decode_e8m0(s):
    """E8M0 byte tensor -> fp32 scale (NaN for 0xFF)."""
    si = s.to(tl.int32)
    return tl.where(si == 255, float("nan"), pow2(si - 127))


@triton.jit
def decode_e2m1(code):
    """4-bit e2m1 code (any int dtype, high bits ignored) -> fp32 value."""
    c = code.to(tl.int32) & 0xF
    e = (c >> 1) & 3
    m = c & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def decode_e4m3(byte):
    """e4m3fn byte (uint8) -> fp32 value (0x7F / 0xFF are NaN)."""
    b = byte.to(tl.int32) & 0xFF
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def round_bf16(x):
    """fp32 -> fp32 holding the round-to-nearest-even bf16 value (NaN kept).

    Written out because the Triton interpreter truncates on fp32 -> bf16 casts; a value that is
    already bf16-representable then casts exactly on every backend.
    """
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))
