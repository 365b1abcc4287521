"""Received rows -> the GEMMs' A operand, once per RECEIVED row (not per pair), so GEMM1 reads it
through ``layout.sorted_row`` (each expert tile loads its rows from wherever they are) and no expert-sorted
copy of A is ever written.

Why per received row: a token that picked several local experts arrives once but is a row of each
of their tiles; converting and copying it per (token, expert) pair wrote top-k times the bytes (at
8192 tokens x top-6 on one rank, 352 MB of e4m3 rows instead of 59 MB). Both kernels run one
program per row and convert every row they are given (the layer passes exactly the rows it
received, each one referenced by a pair).

- ``gather_split_kernel`` (split / frag decoders, MX rows): dequantised to bf16, exactly (e4m3 /
  e2m1 times a power-of-two scale fits bf16); for the split decoder each BK block is stored
  [even | odd] along K (its MMAs read contiguous A tiles and W needs no in-register interleave),
  SPLIT=False keeps natural K order (frag). bf16 rows need no conversion at all: GEMM1 reads them.
- ``rowscale_e4m3_kernel`` (frag8): e4m3 over one scale per row, in the frag8 K order; also GEMM2's
  A2 (expert-sorted rows, padding rows skipped).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .layout_kernels import live_pairs_total, live_to_index
from .mxjit import decode_e2m1, decode_e4m3, decode_e8m0, encode_e4m3, pow2
from .pdl import pdl_enter


@triton.jit
def gather_split_kernel(
    a_ptr, stride_am, as_ptr, stride_asm, out_ptr, stride_om, K,
    A_FMT: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr = True,
    HW_CVT: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Received row r (program axis 0) -> bf16 row r of ``out``; NB K-blocks of BK per program (axis 1)."""
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    m = (blk < K // BK)[:, None]
    if SPLIT:
        j = tl.arange(0, BK // 2)
        kev = blk[:, None] * BK + 2 * j[None, :]  # [NB, BK // 2] even K index of each pair
        if A_FMT == "bf16":
            lo = tl.load(a_ptr + r * stride_am + kev, mask=m, other=0.0).to(tl.float32)
            hi = tl.load(a_ptr + r * stride_am + kev + 1, mask=m, other=0.0).to(tl.float32)
        else:
            s = decode_e8m0(tl.load(as_ptr + r * stride_asm + kev // 32, mask=m, other=127))
            if A_FMT == "fp8":
                lo = decode_e4m3(tl.load(a_ptr + r * stride_am + kev, mask=m, other=0)) * s
                hi = decode_e4m3(tl.load(a_ptr + r * stride_am + kev + 1, mask=m, other=0)) * s
            else:
                b = tl.load(a_ptr + r * stride_am + kev // 2, mask=m, other=0)
                lo = decode_e2m1(b) * s
                hi = decode_e2m1(b >> 4) * s
        base = out_ptr + r * stride_om + blk[:, None] * BK + j[None, :]
        tl.store(base, lo.to(tl.bfloat16), mask=m)
        tl.store(base + BK // 2, hi.to(tl.bfloat16), mask=m)
    else:  # natural K order (frag): contiguous loads, one scale per 32 values
        kk = blk[:, None] * BK + tl.arange(0, BK)[None, :]  # [NB, BK]
        if A_FMT == "bf16":
            v = tl.load(a_ptr + r * stride_am + kk, mask=m, other=0.0)
        else:
            sb = blk[:, None] * (BK // 32) + tl.arange(0, BK // 32)[None, :]
            s = decode_e8m0(tl.load(as_ptr + r * stride_asm + sb, mask=m, other=127))  # [NB, BK // 32]
            if A_FMT == "fp8":
                b = tl.load(a_ptr + r * stride_am + kk, mask=m, other=0)
                if HW_CVT:  # the GPU's e4m3 -> f16 conversion (exact); the integer decode is ALU-bound here
                    x = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                else:
                    x = decode_e4m3(b)
            else:
                j = tl.arange(0, BK // 2)
                b = tl.load(a_ptr + r * stride_am + blk[:, None] * (BK // 2) + j[None, :], mask=m, other=0)
                x = tl.reshape(tl.join(decode_e2m1(b), decode_e2m1(b >> 4)), [NB, BK])
            v = tl.reshape(tl.reshape(x, [NB, BK // 32, 32]) * s[:, :, None], [NB, BK])
        tl.store(out_ptr + r * stride_om + kk, v.to(tl.bfloat16), mask=m)


def rowscale_piece(k: int) -> int:
    """K elements per rowscale_e4m3_kernel step: the largest power of two <= 1024 dividing k (k % 128
    == 0 for frag8, so at least one 128-wide K chunk, the unit of the frag8 K order)."""
    pk = 1024
    while pk > 128 and k % pk:
        pk //= 2
    return pk


@triton.jit
def rowscale_e4m3_kernel(
    sorted_pair_ptr, a_ptr, stride_am, as_ptr, stride_asm, out_ptr, stride_om, rs_ptr, K,
    A_FMT: tl.constexpr, SORTED: tl.constexpr, NB: tl.constexpr, PK: tl.constexpr, HW_CVT: tl.constexpr,
    live_ptr=None, n_seg=1, seg_rows=0, BM=1, PERSIST: tl.constexpr = False, N_SEG: tl.constexpr = 1,
    PDL: tl.constexpr = False, FRAG8_ORDER: tl.constexpr = True,
):
    """MX rows (fp8 bytes or packed fp4, E8M0 per 32) -> e4m3 bytes over ONE power-of-two scale per
    row (rs_ptr, fp32): the frag8 decoder's A operand, so its K loop needs no per-32 rescale.

    One program per row: first the row's block scales (NB >= K / 32) for the row scale, then K in
    steps of PK (rowscale_piece(K)). Row r of ``out`` / ``rs_ptr`` is row r of the input: GEMM1's A
    per received row (SORTED=False; sorted_pair_ptr unused), or GEMM2's A2 in expert-sorted order
    (SORTED=True: padding rows, sorted_pair < 0, are skipped; may run in place, as each step loads
    its bytes before storing them and steps never overlap). The row scale is
    2**(s_max - 127) (NaN if any block is NaN); a block d binades below s_max is shifted down by 2**-d
    and rounded to e4m3 (RNE): exact for fp4 values while d <= 7 and for fp8 values >= 2**(d - 6), the
    smallest lose low bits.
    The bytes are written in the frag8 weights' K order (fragments.fp8_k_order; K % 128 == 0): a
    register permute of each step, so loads and stores stay contiguous; FRAG8_ORDER=False keeps the
    natural K order (the humming provider's A operand, experts/humming/) (when A was still copied per
    pair, H200, 8192 tokens x top-6 on 192 experts, fp8 rows: 166 / 73 us for A (K 7168) / A2 (K
    3072) at 2 warps, against 202 / 127 us for a one-step kernel that stored 4-byte groups at
    computed positions with 8 warps; benchmarks/results/h200_power_ab.json). Once per received row,
    H200, same shapes: A takes 34 us at 2 warps, where the per-pair kernel took 265 us at 8 warps in
    the same call (rowscale_ab.py at 64d6ae2, benchmarks/results/h200_rows_ab.json).

    PERSIST (the live rows of a fixed region, experts/live.py): a fixed grid strides over the live
    rows only: SORTED, the rows of the layout's live tiles (live_ptr: live_tiles, BM rows each);
    else the received rows at the head of each segment (live_ptr: LiveRows.counts, n_seg segments
    of seg_rows rows).

    PDL: launched with programmatic dependent launch (pdl.py): the wait comes before anything else.
    """
    pdl_enter(PDL)
    if not PERSIST:
        r = tl.program_id(0).to(tl.int64)
        if SORTED:
            if tl.load(sorted_pair_ptr + r) < 0:
                return
        _rowscale_row(r, a_ptr, stride_am, as_ptr, stride_asm, out_ptr, stride_om, rs_ptr, K, A_FMT, NB, PK, HW_CVT,
                      FRAG8_ORDER)
    elif SORTED:
        for r in range(tl.program_id(0), tl.load(live_ptr) * BM, tl.num_programs(0)):
            if tl.load(sorted_pair_ptr + r) >= 0:
                _rowscale_row(tl.cast(r, tl.int64), a_ptr, stride_am, as_ptr, stride_asm, out_ptr, stride_om, rs_ptr, K, A_FMT,
                              NB, PK, HW_CVT, FRAG8_ORDER)
    else:
        c, total = live_pairs_total(live_ptr, n_seg, seg_rows, 1, N_SEG)
        for i in range(tl.program_id(0), total, tl.num_programs(0)):
            r = tl.sum(live_to_index(i + tl.zeros([1], tl.int32), c, seg_rows, N_SEG), 0)
            _rowscale_row(r, a_ptr, stride_am, as_ptr, stride_asm, out_ptr, stride_om, rs_ptr, K, A_FMT, NB, PK, HW_CVT,
                          FRAG8_ORDER)


@triton.jit
def _rowscale_row(r, a_ptr, stride_am, as_ptr, stride_asm, out_ptr, stride_om, rs_ptr, K,
                  A_FMT: tl.constexpr, NB: tl.constexpr, PK: tl.constexpr, HW_CVT: tl.constexpr,
                  FRAG8_ORDER: tl.constexpr = True):
    """Row r of rowscale_e4m3_kernel (its docstring)."""
    blk = tl.arange(0, NB)
    smax = tl.max(tl.load(as_ptr + r * stride_asm + blk, mask=blk < K // 32, other=0).to(tl.int32), axis=0)
    for k0 in range(0, K, PK):
        s = tl.load(as_ptr + r * stride_asm + k0 // 32 + tl.arange(0, PK // 32)).to(tl.int32)
        if A_FMT == "fp8":
            b = tl.load(a_ptr + r * stride_am + k0 + tl.arange(0, PK))
            if HW_CVT:
                q = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                q = decode_e4m3(b)
        else:
            b = tl.load(a_ptr + r * stride_am + k0 // 2 + tl.arange(0, PK // 2))
            q = tl.reshape(tl.join(decode_e2m1(b), decode_e2m1(b >> 4)), [PK])
        shift = s - smax  # <= 0; below 2**-126 every value underflows e4m3 anyway
        v = tl.reshape(tl.reshape(q, [PK // 32, 32]) * tl.where(shift >= -126, pow2(shift), 0.0)[:, None], [PK])
        if HW_CVT:
            e4 = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            e4 = encode_e4m3(v)
        if FRAG8_ORDER:  # natural k = 32 c + 8 t + 4 h + i of a 128-wide chunk goes to 32 t + 16 h + 4 c + i
            e4 = tl.reshape(tl.permute(tl.reshape(e4, [PK // 128, 4, 4, 2, 4]), [0, 2, 3, 1, 4]), [PK])
        tl.store(out_ptr + r * stride_om + k0 + tl.arange(0, PK), e4)
    tl.store(rs_ptr + r, tl.where(smax == 255, float("nan"), pow2(smax - 127)))
