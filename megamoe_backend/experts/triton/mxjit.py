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
def block_amax(x):
    """x [B, 32] fp32 -> (amax [B] fp32, 0.0 for a block holding NaN / Inf; bad [B] bool, whether it does).

    One integer max over |x|'s bits: monotonic for non-negative floats, and Inf / NaN bits lie above
    every finite value, so one reduction gives both (robust to max() dropping NaNs; a separate max for
    the NaN test doubled the shuffles of the GEMM epilogues)."""
    abits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    bad = abits >= 0x7F800000
    return tl.where(bad, 0.0, abits.to(tl.float32, bitcast=True)), bad


@triton.jit
def encode_e4m3(v):
    """fp32 -> e4m3fn byte (uint8): RNE, saturate to 448, NaN -> 0x7F | sign. Integer-only rounding."""
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    abits = bits & 0x7FFFFFFF
    ebits = abits >> 23
    # subnormal range (|v| < 2**-6): code = RNE(|v| * 2**9) = RNE(mant24 >> (141 - ebits)); 0 for fp32 subnormals
    mant24 = (abits & 0x7FFFFF) | 0x800000
    sh = tl.minimum(tl.maximum(141 - ebits, 1), 31)
    q = mant24 >> sh
    rem = mant24 & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    sub = tl.where(ebits == 0, 0, sub)
    keep = (abits & 0x7FFFFF) >> 20
    rem_n = abits & 0xFFFFF
    up = (rem_n > 0x80000) | ((rem_n == 0x80000) & ((keep & 1) == 1))
    nrm = ((ebits - 120) << 3) + keep + up.to(tl.int32)
    code = tl.where(ebits < 121, sub, nrm)
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


@triton.jit
def fake_quant_blocks(x, FMT: tl.constexpr):
    """x [B, 32] fp32 -> dequantize(quantize_mx(x)) in fp32, bit-exact (NaN blocks -> NaN)."""
    amax, bad = block_amax(x)
    if FMT == "fp8":
        e = scale_exponent(amax, FP8_MANT_LIMIT, FP8_MAX_EXP)
        q = decode_e4m3(encode_e4m3(x * pow2(-e)[:, None]))
    else:
        e = scale_exponent(amax, FP4_MANT_LIMIT, FP4_MAX_EXP)
        q = decode_e2m1(encode_e2m1(x * pow2(-e)[:, None]))
    return tl.where(bad[:, None], float("nan"), q * pow2(e)[:, None])


# e2m1 nibbles -> bf16 with the block scale, 8 values (one 32-bit register of 4 packed bytes) per call.
# Triton packs 4 consecutive register elements of a thread; only pairs (0,1) and (2,3) are adjacent
# bytes for sure, so each pair takes its own scale register ($5 for bytes 0-1, $6 for bytes 2-3).
# Nibble bits s e1 e0 m placed as bf16 sign (bit 15) and exponent/mantissa (bits 8..6) give exactly
# value * 2**-126 for every code (0.5 lands on the bf16 subnormal 2**-127); one bf16x2 multiply by the
# scale operand 2**(s - 64) gives value * 2**(s - 127) * 2**-63 (exact while s >= 58, i.e. block
# scales >= 2**-69), and the GEMM multiplies its fp32 accumulator by 2**63 once at the end.
_LUT_ASM = tl.constexpr("""
{
.reg .b32 t0, t1, a, b;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shl.b32 a, t0, 6;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t0, 12;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 $0, a, $5;
shl.b32 a, t1, 6;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t1, 12;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 $1, a, $6;
shl.b32 a, t0, 2;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t0, 8;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 $2, a, $5;
shl.b32 a, t1, 2;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t1, 8;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 $3, a, $6;
}
""")


SPLIT_UNSCALE = tl.constexpr(9.223372036854775808e18)  # 2**63


@triton.jit
def scale_bf16_shifted(s):
    """E8M0 byte -> bf16 2**(s - 64) (the LUT decoder's scale operand); 0xFF -> NaN.

    Exact for s <= 191 (block scales up to 2**64); larger scales do not occur in weights.
    """
    si = s.to(tl.int32)
    bits = tl.where(si == 255, 0x7FC0, tl.minimum(si + 63, 254) << 7)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def decode_fp4_split(packed, scale_bf16, USE_ASM: tl.constexpr):
    """packed e2m1 bytes [R, C] + bf16 scale operand [R, C] -> (low-nibble, high-nibble) bf16 [R, C],
    both equal to the true weights times 2**-63 (SPLIT_UNSCALE undoes it on the accumulator)."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            _LUT_ASM, "=r,=r,=r,=r,r,r,r", [packed, scale_bf16],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )
    else:  # same values through the portable helpers (Triton interpreter)
        sv = scale_bf16.to(tl.float32) * 1.1754943508222875e-38  # 2**(s - 64) * 2**-126, as the asm
        lo = (decode_e2m1(packed) * sv).to(tl.bfloat16)
        hi = (decode_e2m1(packed >> 4) * sv).to(tl.bfloat16)
    return lo, hi


# One 32-bit word of a fragment-ordered MXFP4 block (experts/triton/fragments.py) -> the four bf16x2
# registers of one lane's wgmma A fragment: X (rows g, g+8; K 2c, 2c+1) and Y (same rows, K + 8).
# $4: the word (4 packed bytes), $5 / $7: bf16x2 scale pairs 2**(s - 64) of rows g / g+8.
_FRAG_ASM = tl.constexpr("""
{
.reg .b32 a, b, c, d, e;
and.b32 a, $4, 0x81C081C0;
mul.rn.bf16x2 $0, a, $5;
shl.b32 b, $4, 6;
and.b32 b, b, 0x81C081C0;
mul.rn.bf16x2 $1, b, $7;
shf.l.wrap.b32 c, $4, $4, 12;
and.b32 c, c, 0x81C081C0;
mul.rn.bf16x2 $2, c, $5;
shl.b32 d, $4, 2;
and.b32 d, d, 0x80C080C0;
shr.b32 e, $4, 6;
and.b32 e, e, 0x01000100;
or.b32 d, d, e;
mul.rn.bf16x2 $3, d, $7;
}
""")


@triton.jit
def _bf16_half(bits, scale):
    """16-bit field (int32, value * 2**-126 as bf16 bits) times fp32 scale -> bf16 (exact products)."""
    return ((bits & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True) * scale


@triton.jit
def decode_fp4_frag(words, pairs, USE_ASM: tl.constexpr):
    """Fragment words uint8 [..., 16] + int32 scale pairs [..., 16] -> (X, Y) bf16 [..., 16].

    Byte 4 * step + 2 * dr + dk of a lane carries X = W[row dr, K dk] and Y = the same at K + 8;
    values are the true weights times 2**-63 (SPLIT_UNSCALE undoes it on the accumulator). The
    portable path (interpreter) assembles each word and applies fragments.decode_words_reference.
    """
    if USE_ASM:
        x, y = tl.inline_asm_elementwise(
            _FRAG_ASM, "=r,=r,=r,=r,r,r,r,r,r", [words, pairs],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )
    else:
        shape: tl.constexpr = words.shape
        b = tl.reshape(words.to(tl.int64), [shape[0], shape[1], shape[2], 4, 4])
        sh = (tl.arange(0, 4) * 8).to(tl.int64)
        w = tl.sum(b << sh[None, None, None, None, :], axis=4)  # [.., 32, 4 steps] word per step
        r0 = w & 0x81C081C0
        r1 = (w << 6) & 0x81C081C0
        r2 = (((w << 12) | (w >> 20)) & 0xFFFFFFFF) & 0x81C081C0
        r3 = ((w << 2) & 0x80C080C0) | ((w >> 6) & 0x01000100)
        sp = tl.reshape(pairs, [shape[0], shape[1], shape[2], 4, 4])
        s_g = tl.max(tl.reshape(sp, [shape[0], shape[1], shape[2], 4, 2, 2]), axis=5)  # pairs are constant over dk
        s_g = ((s_g & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        sg, sg8 = tl.split(s_g)
        xa = tl.join(_bf16_half(r0, sg), _bf16_half(r0 >> 16, sg))  # dr 0: dk 0, 1
        xb = tl.join(_bf16_half(r1, sg8), _bf16_half(r1 >> 16, sg8))  # dr 1
        ya = tl.join(_bf16_half(r2, sg), _bf16_half(r2 >> 16, sg))
        yb = tl.join(_bf16_half(r3, sg8), _bf16_half(r3 >> 16, sg8))
        x = tl.reshape(tl.permute(tl.join(xa, xb), [0, 1, 2, 3, 5, 4]), shape).to(tl.bfloat16)
        y = tl.reshape(tl.permute(tl.join(ya, yb), [0, 1, 2, 3, 5, 4]), shape).to(tl.bfloat16)
    return x, y


# One 32-bit word of an fp8-kind fragment block + its two PRMT tables -> the e4m3x4 registers of rows
# g ($0) and g+8 ($1) of one lane's wgmma e4m3 A fragment, block scale folded in (see fragments.py).
# $3/$4: table of row g (entries 0-3 / 4-7), $5/$6: of row g+8.
_FRAG8_ASM = tl.constexpr("""
{
.reg .b32 s, t, m;
and.b32 m, $2, 0x77777777;
prmt.b32 s, $3, $4, m;
and.b32 t, $2, 0x80808080;
or.b32 $0, s, t;
shr.b32 s, m, 16;
prmt.b32 s, $5, $6, s;
shl.b32 t, $2, 4;
and.b32 t, t, 0x80808080;
or.b32 $1, s, t;
}
""")


@triton.jit
def _prmt_lookup(table, sel):
    """PRMT with selector nibbles < 8, in integer ops: byte i = byte (sel >> 4 i) & 7 of the int64 table."""
    out = tl.zeros_like(sel)
    for i in tl.static_range(4):
        out |= ((table >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i)
    return out


@triton.jit
def decode_fp4_frag8(words, luts, USE_ASM: tl.constexpr):
    """fp8-kind fragment words uint8 [..., 16] (4 words per lane) + int32 tables [..., 16] (for each
    word: lo / hi of row g, lo / hi of row g+8) -> (rows g, rows g+8) e4m3 bytes, uint8 [..., 16].
    The PTX takes 4 consecutive register elements: bytes 0..3 of a word."""
    if USE_ASM:
        x, y = tl.inline_asm_elementwise(_FRAG8_ASM, "=r,=r,r,r,r,r,r", [words, luts], dtype=(tl.uint8, tl.uint8),
                                         is_pure=True, pack=4)
    else:
        shape: tl.constexpr = words.shape
        n: tl.constexpr = shape[0] * shape[1] * shape[2] * 4
        sh = (tl.arange(0, 4) * 8).to(tl.int64)
        w = tl.sum(tl.reshape(words.to(tl.int64), [n, 4]) << sh[None, :], axis=1)  # one word per row
        t = tl.reshape(luts.to(tl.int64) & 0xFFFFFFFF, [n, 2, 2])
        lo, hi = tl.split(t)  # [n, 2]: row g, row g + 8
        lo_x, lo_y = tl.split(lo)
        hi_x, hi_y = tl.split(hi)
        m = w & 0x77777777
        r0 = _prmt_lookup(lo_x | (hi_x << 32), m) | (w & 0x80808080)
        r1 = _prmt_lookup(lo_y | (hi_y << 32), m >> 16) | ((w << 4) & 0x80808080)
        x = tl.reshape((r0[:, None] >> sh[None, :]) & 0xFF, shape).to(tl.uint8)
        y = tl.reshape((r1[:, None] >> sh[None, :]) & 0xFF, shape).to(tl.uint8)
    return x, y
