"""MXFP4 weights re-laid out as Hopper MMA register fragments (the ``frag`` / ``frag8`` decoders' input).

Why: the e2m1 decode, not HBM, limited the plain-layout kernels (docs/triton.md). Two costs went
away by moving work to weight-load time, once per layer:
1. Shuffles. In the wgmma A-operand layout a thread holds, per 16 x 16 tile, rows g and g+8 and
   K columns {2c, 2c+1, 2c+8, 2c+9} (lane = 4g + c). Stored row-major, those 8 weights sit in 4
   different places, so every load needs byte repacking. Here each lane's 8 weights of one k16 step
   are one 32-bit word, and its 4 words of one 64-wide K chunk are 16 contiguous bytes: one 128-bit
   load per lane, 32 lanes = 512 contiguous bytes per (16 rows x 64 K) block.
2. Decode instructions. The 8 nibbles inside the word are bit-twiddled so that each of the four
   bf16x2 registers the MMA wants is one mask away (``x & M``, ``(x << 6) & M``, ``rotl(x, 12) & M``,
   and two masked shifts for the last), where M puts a nibble's sign at the bf16 sign bit and its
   3 magnitude bits at bf16 bits 8..6: that bf16 is exactly value * 2**-126 for every code (0.5 is
   the subnormal 2**-127), and one bf16x2 multiply by 2**(s - 64) applies the E8M0 scale (the fp32
   accumulator is multiplied by 2**63 once, as in the split decoder).

Word layout (bit -> nibble field), for X = W[n, k], Y = W[n, k + 8] and r = 2 * dr + dk selecting
n = 16 * rb + 8 * dr + g and k = 64 * kb + 16 * step + 2 * c + dk:
    X[r=0]: sign 15, mag 8..6     X[1]: sign 31, mag 24..22     (register 0 = x & M)
    X[2]:   sign 9,  mag 2..0     X[3]: sign 25, mag 18..16     (register 1 = (x << 6) & M)
    Y[0]:   sign 3,  mag 28..26   Y[1]: sign 19, mag 12..10     (register 2 = rotl(x, 12) & M)
    Y[2]:   sign 13, mag 14,5,4   Y[3]: sign 29, mag 30,21,20   (register 3, two masked shifts)
Scales become [E, N/16, K/64, 8 (g), 4 (block j, dr)] bytes holding s + 63 (the bf16 exponent of
2**(s - 64)), so a lane reads one 32-bit word of scales per 64-wide K chunk.

Limits (checked here, once, with a clear error): N % 16 == 0, K % 64 == 0, every E8M0 weight scale
in [58, 191] (2**-69 .. 2**64; outside it the shifted-scale trick would round or overflow).

A second kind, "fp8", feeds the FP8 tensor cores (decoder ``frag8``, A8W4 / A4W4) with one long
K loop (no per-32 rescale of partial sums): the E8M0 block scales are folded into the decoded e4m3
weights, relative to one power-of-two scale per weight row that the epilogue applies. The wgmma e4m3
A fragment gives a lane, per 16 x 32 tile, 4 consecutive K of rows g and g+8 in one register each
(K 4c .. 4c+3, and again at K + 16). One word holds those 8 weights, laid out for PRMT table lookups:
row g's 3-bit magnitudes in nibbles 0-3 (bits 4i..4i+2) and signs at bits 8i+7, row g+8's
magnitudes in nibbles 4-7 and signs at bits 8i+3, so that
    m = x & 0x77777777
    X = prmt(lut_g, m) | (x & 0x80808080)                 (prmt reads the low 16 bits of m)
    Y = prmt(lut_g8, m >> 16) | ((x << 4) & 0x80808080)   (7 instructions per word)
where a lut is the 8 e4m3 bytes of the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} x 2**(S - 5): the
kernel builds it with two integer multiply-adds from the block's 4-bit S (FP8_LUT_LO/HI + 8 S x
0x01010100 / 0x01010101). S = s - row_ref + 5 in [0, 11] with row_ref = max(s over the row) - 6, so
every value e2m1 x 2**(S - 5) is a normal e4m3 number (exact), and the row keeps 2**(row_ref - 127)
as an fp32 ``row_scale``. Limits (checked once, clear error): a row's block scales (of blocks with a
non-zero value) span at most 11 binades, no NaN scale.

**K order (fp8 kind).** A table serves only the weights of its own 32-block, and in the natural K
order a lane's 16 weights of a row per 128-wide K step come from all four blocks of the step: four
tables per row and step. The fp8 kind therefore permutes K inside every 128-wide chunk, so that all
of lane c's weights of that chunk (MMA positions 32 t + 16 h + 4 c + i, t = k32 step, h = half,
i < 4) are block c of the chunk (original K 32 c + 8 t + 4 h + i; ``fp8_k_order``): one table per
row and K step (4x fewer table instructions; the K loop 17-20 % fewer instructions). The
activations must follow the same order: the frag8 A operand is written permuted by the gather
(``gather.rowscale_e4m3_kernel``), and the product is unchanged because both operands are permuted
alike. Needs K % 128 == 0 and a K step of 128. S bytes: [E, N/16, K/128, 8 (g), 4 (c), 2 (dr)],
the 2 bytes a lane needs per 16-row block and 128-wide step next to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FRAG_ROWS = 16  # rows per fragment block (one warp's wgmma slab)
FRAG_K = 64  # K per fragment block (16 bytes per lane)
FP8_K = 128  # fp8 kind: K chunk inside which K is permuted (fp8_k_order) and the frag8 K step
KINDS = ("bf16", "fp8")
SCALE_MIN, SCALE_MAX = 58, 191  # bf16 kind
FP8_S_MAX = 11  # fp8 kind: S = s - row_ref + 5, S - 5 in [-5, 6] keeps e2m1 x 2**(S - 5) normal in e4m3
FP8_LUT_LO, FP8_LUT_HI = 0x14100800, 0x24201C18  # e4m3 bytes of {0, .5, 1, 1.5} / {2, 3, 4, 6} x 2**-5
SCALE_BIAS = 63  # bf16 kind: stored scale byte = s + 63 = bf16 exponent field of 2**(s - 64)
BF16_MASK = 0x81C081C0

# (sign bit, [e1, e0, m] bits) of the 8 nibble fields of a word, per kind.
# bf16: X0 X1 X2 X3 Y0 Y1 Y2 Y3 (X = K, Y = K + 8; r = 2 * dr + dk)
# fp8:  X0..X3 (row g, K + i: mag in nibble i, sign 8i+7), Y0..Y3 (row g + 8: nibble 4 + i, sign 8i+3)
FIELDS = {
    "bf16": (
        (15, (8, 7, 6)), (31, (24, 23, 22)),
        (9, (2, 1, 0)), (25, (18, 17, 16)),
        (3, (28, 27, 26)), (19, (12, 11, 10)),
        (13, (14, 5, 4)), (29, (30, 21, 20)),
    ),
    "fp8": tuple((7 + 8 * i, (4 * i + 2, 4 * i + 1, 4 * i)) for i in range(4))
    + tuple((3 + 8 * i, (16 + 4 * i + 2, 16 + 4 * i + 1, 16 + 4 * i)) for i in range(4)),
}


def fp8_k_order(k: int) -> torch.Tensor:
    """int64 [k]: the original K index stored at each MMA K position by the fp8 kind (module docstring):
    position 128 q + 32 t + 16 h + 4 c + i holds K = 128 q + 32 c + 8 t + 4 h + i."""
    if k % FP8_K:
        raise ValueError(f"fp8 fragment K order needs K % {FP8_K} == 0, got K={k}")
    q, t, h, c, i = torch.meshgrid(*(torch.arange(n) for n in (k // FP8_K, 4, 2, 4, 4)), indexing="ij")
    return (FP8_K * q + 32 * c + 8 * t + 4 * h + i).reshape(k)


def _block_map(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, K) inside a 16 x 64 block of each (lane, word, field): two int64 [32, 4, 8] tables."""
    lane = torch.arange(32).view(32, 1, 1)
    word = torch.arange(4).view(1, 4, 1)
    field = torch.arange(8).view(1, 1, 8)
    g, c = lane // 4, lane % 4
    if kind == "bf16":  # word = k16 step; field = 4 h + 2 dr + dk
        h, dr, dk = field // 4, (field // 2) % 2, field % 2
        return (8 * dr + g).expand(32, 4, 8), (16 * word + 8 * h + 2 * c + dk).expand(32, 4, 8)
    h, i = field // 4, field % 4  # fp8: field = 4 h + i, word j = 2 * b3 + b2
    return (8 * h + g).expand(32, 4, 8), (32 * (word // 2) + 16 * (word % 2) + 4 * c + i).expand(32, 4, 8)


@dataclass(frozen=True)
class FragmentWeights:
    """One weight matrix stack [E, N, K] in fragment order (see the module docstring)."""

    words: torch.Tensor  # uint8 [E, N/16, K/64, 32, 16]
    scales: torch.Tensor  # bf16 kind: uint8 [E, N/16, K/64, 8, 4] s + 63; fp8: [E, N/16, K/128, 8, 4, 2] S = s - row_ref + 5
    n: int
    k: int
    kind: str = "bf16"
    row_scale: torch.Tensor | None = None  # fp8 kind: fp32 [E, N] = 2**(row_ref - 127)


def check_fragment_shape(name: str, n: int, k: int, kind: str = "bf16") -> None:
    kq = FP8_K if kind == "fp8" else FRAG_K
    if n % FRAG_ROWS or k % kq:
        decoder = "frag8" if kind == "fp8" else "frag"
        raise ValueError(
            f"{name}: [{n}, {k}] cannot use the {decoder} decoder (rows must be a multiple of {FRAG_ROWS}, "
            f"K a multiple of {kq})"
        )


def scale_shape(kind: str, e: int, n: int, k: int) -> tuple[int, ...]:
    """Shape of FragmentWeights.scales (same bytes as the E8M0 [E, N, K/32] it replaces)."""
    if kind == "fp8":
        return (e, n // FRAG_ROWS, k // FP8_K, 8, 4, 2)
    return (e, n // FRAG_ROWS, k // FRAG_K, 8, 4)


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] (even K in the low nibble) -> int32 codes [..., K]."""
    p = packed.to(torch.int32)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def _check_scales(name: str, scales: torch.Tensor, kind: str) -> None:
    lo, hi = (int(scales.min()), int(scales.max())) if scales.numel() else (SCALE_MIN, SCALE_MIN)
    if kind == "bf16" and (lo < SCALE_MIN or hi > SCALE_MAX):
        raise ValueError(
            f"{name}_scale: E8M0 bytes span [{lo}, {hi}]; the frag decoder is exact only for [{SCALE_MIN}, {SCALE_MAX}] "
            "(block scales 2**-69 .. 2**64): use decoder='split' or 'dot_scaled' for these weights"
        )
    if kind == "fp8" and hi == 255:
        raise ValueError(f"{name}_scale: E8M0 byte 255 (NaN); the frag8 decoder folds scales into e4m3 weights")


class FoldSpanError(ValueError):
    """A weight row whose block scales span more binades than the frag8 decoder folds exactly: the
    tensor, expert, row and block found first, and the spread (row max over that block, in binades),
    so a caller that falls back to another decoder can say what it fell back for."""

    def __init__(self, name: str, expert: int, row: int, block: int, block_exp: int, row_max_exp: int) -> None:
        self.tensor, self.expert, self.row, self.block = name, expert, row, block
        self.block_exp, self.row_max_exp = block_exp, row_max_exp
        self.spread = row_max_exp - block_exp  # binades between the row's largest block scale and this one
        super().__init__(
            f"{name}_scale: expert {expert} row {row} has block scales spanning more than {FP8_S_MAX} binades "
            f"(block {block}: 2**{block_exp} vs row max 2**{row_max_exp}); the frag8 decoder "
            "folds them into e4m3 weights exactly only within that span: use decoder='frag' for these weights"
        )


def _fp8_row_fold(name: str, codes: torch.Tensor, scales: torch.Tensor, expert0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int [E, N, K], E8M0 [E, N, K/32] -> (S uint8 [E, N, K/32], row_scale fp32 [E, N]) of the fp8 kind."""
    s = scales.to(torch.int32)
    live = (codes & 7).reshape(*scales.shape, 32).ne(0).any(dim=-1)  # blocks holding a non-zero value
    top = torch.where(live, s, 0).amax(dim=-1, keepdim=True)
    ref = (top - 6).clamp_min(1)  # row_scale = 2**(ref - 127) stays a normal fp32
    fold = torch.where(live, s - ref + 5, 0)  # <= FP8_S_MAX by the choice of ref; < 0: span too wide
    if fold.numel() and int(fold.min()) < 0:
        bad = (fold < 0).nonzero()[0].tolist()
        raise FoldSpanError(name, expert0 + bad[0], bad[1], bad[2], int(s[tuple(bad)]) - 127,
                            int(top[bad[0], bad[1], 0]) - 127)
    return fold.to(torch.uint8), torch.pow(2.0, (ref[..., 0] - 127).double()).float()


def to_fragments(name: str, packed: torch.Tensor, scales: torch.Tensor, kind: str = "bf16", _expert0: int = 0) -> FragmentWeights:
    """uint8 e2m1 [E, N, K/2] + E8M0 [E, N, K/32] -> FragmentWeights (pure torch, any device)."""
    if kind not in KINDS:
        raise ValueError(f"fragment kind {kind!r}; expected one of {KINDS}")
    e, n, k2 = packed.shape
    k = 2 * k2
    check_fragment_shape(name, n, k, kind)
    if tuple(scales.shape) != (e, n, k // 32):
        raise ValueError(f"{name}_scale: expected [{e}, {n}, {k // 32}], got {tuple(scales.shape)}")
    _check_scales(name, scales, kind)
    if e > 1:  # one expert at a time: the int64 temporaries are 16x the packed bytes
        parts = [to_fragments(name, packed[i : i + 1], scales[i : i + 1], kind, i) for i in range(e)]
        row_scale = torch.cat([f.row_scale for f in parts]) if kind == "fp8" else None
        return FragmentWeights(torch.cat([f.words for f in parts]), torch.cat([f.scales for f in parts]), n, k, kind, row_scale)
    rb, kb = n // FRAG_ROWS, k // FRAG_K
    all_codes = _codes(packed)
    mma_codes = all_codes[..., fp8_k_order(k).to(packed.device)] if kind == "fp8" else all_codes
    blocks = mma_codes.reshape(rb, FRAG_ROWS, kb, FRAG_K).permute(0, 2, 1, 3).to(torch.int64)  # [rb, kb, 16, 64]
    rows, cols = (t.to(packed.device) for t in _block_map(kind))
    codes = blocks[:, :, rows, cols]  # [rb, kb, 32 lanes, 4 words, 8 fields]
    word = torch.zeros(codes.shape[:-1], dtype=torch.int64, device=packed.device)
    for f, (sign, mag) in enumerate(FIELDS[kind]):
        c = codes[..., f]
        word |= ((c >> 3) & 1) << sign
        for bit, src in zip(mag, (2, 1, 0)):
            word |= ((c >> src) & 1) << bit
    words = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)  # little-endian
    words = words.reshape(1, rb, kb, 32, 16).contiguous()
    row_scale = None
    if kind == "fp8":
        stored, row_scale = _fp8_row_fold(name, all_codes.reshape(1, n, k), scales, _expert0)
        # S[e, rb, dr, g, q, c] -> [e, rb, q, g, c, dr]
        stored = stored.reshape(e, rb, 2, 8, k // FP8_K, 4).permute(0, 1, 4, 3, 5, 2)
    else:  # scales[e, rb, dr, g, kb, j] -> [e, rb, kb, g, j, dr]
        stored = (scales.to(torch.int32) + SCALE_BIAS).to(torch.uint8)
        stored = stored.reshape(e, rb, 2, 8, kb, 2).permute(0, 1, 4, 3, 5, 2)
    stored = stored.reshape(scale_shape(kind, e, n, k))
    return FragmentWeights(words, stored.contiguous(), n, k, kind, row_scale)


def from_fragments(f: FragmentWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of to_fragments (tests, as_rowmajor): -> (packed [E, N, K/2], scales [E, N, K/32])."""
    e, rb, kb = f.words.shape[:3]
    b = f.words.to(torch.int64).reshape(e, rb, kb, 32, 4, 4)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    codes = torch.zeros(e, rb, kb, FRAG_ROWS, FRAG_K, dtype=torch.int64, device=f.words.device)
    rows, cols = (t.to(f.words.device) for t in _block_map(f.kind))
    for fi, (sign, mag) in enumerate(FIELDS[f.kind]):
        c = ((word >> sign) & 1) << 3
        for bit, dst in zip(mag, (2, 1, 0)):
            c |= ((word >> bit) & 1) << dst
        codes[:, :, :, rows[..., fi], cols[..., fi]] = c
    codes = codes.permute(0, 1, 3, 2, 4).reshape(e, f.n, f.k)
    if f.kind == "fp8":  # MMA K positions -> natural K
        natural = torch.empty_like(codes)
        natural[..., fp8_k_order(f.k).to(codes.device)] = codes
        codes = natural
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    if f.kind == "bf16":
        s = f.scales.to(torch.int32).reshape(e, rb, kb, 8, 2, 2).permute(0, 1, 5, 3, 2, 4).reshape(e, f.n, f.k // 32)
        return packed, (s - SCALE_BIAS).to(torch.uint8)
    # [e, rb, q, g, c, dr] -> [e, rb, dr, g, q, c]
    s = f.scales.to(torch.int32).reshape(e, rb, f.k // FP8_K, 8, 4, 2).permute(0, 1, 5, 3, 2, 4).reshape(e, f.n, f.k // 32)
    # fp8 kind: s = S + row_ref - 5; a block without a non-zero value kept no scale (S = 0), so it gets
    # the smallest byte its row can express there (its values are zero either way)
    ref = torch.frexp(f.row_scale.double())[1].to(torch.int32) - 1 + 127  # row_scale = 2**(ref - 127)
    return packed, (s + ref[..., None] - 5).clamp(0, 254).to(torch.uint8)


def fp8_luts(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8-kind S bytes -> the two 32-bit PRMT tables (int64) the kernel builds from each."""
    rep = stored.to(torch.int64) * 8
    return FP8_LUT_LO + rep * 0x01010100, FP8_LUT_HI + rep * 0x01010101


def _prmt(lo: torch.Tensor, hi: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """PTX prmt.b32 (default mode, selector nibbles < 8): byte i = byte sel[4i:4i+3] of {hi, lo}."""
    table = lo | (hi << 32)
    return sum((((table >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i)) for i in range(4))


def decode_words_reference(words: torch.Tensor, kind: str = "bf16", luts=None) -> torch.Tensor:
    """What the kernel's PTX does to each 32-bit word, in torch (tests): uint8 [..., 4] -> int64 [..., R]:
    bf16 kind: the four masked bf16x2 registers (before the scale multiply); fp8 kind: the two e4m3x4
    registers (rows g and g + 8), given ``luts`` = ((lo_g, hi_g), (lo_g8, hi_g8)) from fp8_luts,
    broadcastable to the words."""
    b = words.to(torch.int64)
    x = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    if kind == "fp8":
        (xlo, xhi), (ylo, yhi) = luts
        m = x & 0x77777777  # every selector nibble < 8; prmt reads the low 16 bits
        r0 = _prmt(xlo, xhi, m) | (x & 0x80808080)
        r1 = _prmt(ylo, yhi, m >> 16) | ((x << 4) & 0x80808080)
        return torch.stack((r0, r1), dim=-1)
    r0 = x & BF16_MASK
    r1 = (x << 6) & BF16_MASK
    r2 = (((x << 12) | (x >> 20)) & 0xFFFFFFFF) & BF16_MASK
    r3 = ((x << 2) & 0x80C080C0) | ((x >> 6) & 0x01000100)
    return torch.stack((r0, r1, r2, r3), dim=-1)
