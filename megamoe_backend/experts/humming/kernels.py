"""The steps between humming's GEMMs that its epilogue cannot do, as small Triton kernels.

humming's indexed GEMM writes bf16 rows and applies one scale per A row and one per weight row; the
experts need more around it (experts/base.py):

- ``swiglu_a2_kernel`` (after GEMM1): each live pair's gate/up row (bf16, interleaved [g0, u0, g1, ...]
  as the project stores w1) -> SwiGLU (+ clamp) -> A2 quantised as the frag8 path does it: MX fp8 per 1x32
  block (quant.quantize_blocks, the GEMM1 epilogue's quantiser), then re-expressed as e4m3 over one
  power-of-two scale per row (gather.rowscale_e4m3_kernel's rule). GEMM2 takes that row scale times the
  pair's route weight as its per-row input scale, so humming's epilogue applies the route weight on the
  fp32 accumulator and GEMM2's bf16 row is the bf16 combine wire row, rounded once.
- ``finalize_kernel`` (after GEMM2, when its rows cannot be the output as they are): each live pair's
  bf16 row -> fp32 rows, a copy into a destination (a transport's table or per-segment bases), or the
  fp8_blockwise_1x32 wire row (e4m3 payload, then one E8M0 scale per 32 at byte H + block).

For block-FP8 experts (DeepSeek V3 / R1 FP8: A in 1 x 128 groups, humming's block-scaled GEMMs):

- ``group_rows_kernel`` (before GEMM1): the received fp8_g128 rows (views of wire rows: e4m3 bytes and fp32 group
  scales at a row stride) copied into the contiguous [N, H] / [N, H/128] tensors humming's launcher takes; the
  live received rows only where a LiveRows bounds them;
- ``swiglu_g128_kernel`` (after GEMM1): each live pair's [gate; up] row (bf16, plain: the checkpoint's order) ->
  SwiGLU (+ clamp) -> A2 in 1 x 128 groups (quant.quantize_g128, the Triton GEMM1 epilogue's quantiser), each
  group scale times the pair's route weight: GEMM2's epilogue applies the route weight with the group scales.

The layout-walking kernels walk the rows of the expert-sorted layout's live tiles (``live_tiles`` x BM, read on the device)
with a fixed grid, skipping padding rows (pair < 0): capturable, and a forward costs its live pairs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton.layout_kernels import live_pairs_total, live_to_index
from ..triton.mxjit import decode_e4m3, encode_e4m3, pow2
from ..triton.quant import quantize_blocks, quantize_g128


@triton.jit
def swiglu_a2_kernel(
    sorted_pair_ptr, live_tiles_ptr, BM, h_ptr, stride_h, route_w_ptr, a2_ptr, stride_a2, rs_ptr, I, limit,
    NI: tl.constexpr, HAS_LIMIT: tl.constexpr, HW_CVT: tl.constexpr,
):
    """Pair p = sorted_pair[r] of each live layout row r: h[p] (bf16 [2I]) -> a2[p] (e4m3 [I]) and
    rs[p] = 2**(s_max - 127) * route_w[p] (NaN for a row holding NaN / Inf). NI: I rounded up to a power of two."""
    j = tl.arange(0, NI)
    jj = tl.arange(0, 2 * NI)
    blk = tl.arange(0, NI // 32)
    for r in range(tl.program_id(0), tl.load(live_tiles_ptr) * BM, tl.num_programs(0)):
        p = tl.load(sorted_pair_ptr + r)
        if p >= 0:
            p64 = p.to(tl.int64)
            gu = tl.load(h_ptr + p64 * stride_h + jj, mask=jj < 2 * I, other=0.0).to(tl.float32)
            gate, up = tl.split(tl.reshape(gu, [NI, 2]))
            if HAS_LIMIT:
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
            act = gate / (1.0 + tl.exp(-gate)) * up
            payload, scales = quantize_blocks(tl.reshape(act, [NI // 32, 32]), "fp8", HW_CVT)
            s = tl.where(blk < I // 32, scales.to(tl.int32), 0)
            smax = tl.max(s, axis=0)
            if HW_CVT:
                q = payload.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                q = decode_e4m3(payload)
            shift = s - smax  # <= 0; a block d binades below the row's largest keeps what e4m3 holds of it
            v = q * tl.where(shift >= -126, pow2(shift), 0.0)[:, None]
            if HW_CVT:
                e4 = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            else:
                e4 = encode_e4m3(v)
            tl.store(a2_ptr + p64 * stride_a2 + j, tl.reshape(e4, [NI]), mask=j < I)
            rs = tl.where(smax == 255, float("nan"), pow2(smax - 127))
            tl.store(rs_ptr + p64, rs * tl.load(route_w_ptr + p64))


@triton.jit
def group_rows_kernel(
    data_ptr, stride_d, scale_ptr, stride_s, out_ptr, out_scale_ptr, K, G,
    BK: tl.constexpr, NG: tl.constexpr, live_ptr=None, n_seg=1, seg_rows=0, PERSIST: tl.constexpr = False,
    N_SEG: tl.constexpr = 1,
):
    """Row r of the received fp8_g128 rows (bytes at data_ptr + r * stride_d, G = K / 128 fp32 scales at
    scale_ptr + r * stride_s, in 4-byte elements) -> row r of the contiguous out [N, K] / out_scale [N, G]. One
    program per row, or PERSIST: a fixed grid over the live received rows (LiveRows: n_seg segments of seg_rows
    rows, counts at live_ptr). NG >= G a power of two; BK columns a step."""
    if not PERSIST:
        _group_row(tl.program_id(0).to(tl.int64), data_ptr, stride_d, scale_ptr, stride_s, out_ptr, out_scale_ptr, K, G,
                   BK, NG)
    else:
        c, total = live_pairs_total(live_ptr, n_seg, seg_rows, 1, N_SEG)
        for i in range(tl.program_id(0), total, tl.num_programs(0)):
            r = tl.sum(live_to_index(i + tl.zeros([1], tl.int32), c, seg_rows, N_SEG), 0).to(tl.int64)
            _group_row(r, data_ptr, stride_d, scale_ptr, stride_s, out_ptr, out_scale_ptr, K, G, BK, NG)


@triton.jit
def _group_row(r, data_ptr, stride_d, scale_ptr, stride_s, out_ptr, out_scale_ptr, K, G, BK: tl.constexpr,
               NG: tl.constexpr):
    g = tl.arange(0, NG)
    tl.store(out_scale_ptr + r * G + g, tl.load(scale_ptr + r * stride_s + g, mask=g < G), mask=g < G)
    k = tl.arange(0, BK)
    for k0 in range(0, K, BK):
        tl.store(out_ptr + r * K + k0 + k, tl.load(data_ptr + r * stride_d + k0 + k, mask=k0 + k < K), mask=k0 + k < K)


@triton.jit
def swiglu_g128_kernel(
    sorted_pair_ptr, live_tiles_ptr, BM, h_ptr, stride_h, route_w_ptr, a2_ptr, stride_a2, s_ptr, stride_s, I, limit,
    HAS_LIMIT: tl.constexpr, HW_CVT: tl.constexpr,
):
    """Pair p = sorted_pair[r] of each live layout row r, one 128-column group at a time: h[p] (bf16 [gate; up],
    2I) -> a2[p] (e4m3 [I]) and s[p, group] = scale of the group (quantize_g128) x route_w[p]."""
    j = tl.arange(0, 128)
    groups = I // 128
    for u in range(tl.program_id(0), tl.load(live_tiles_ptr) * BM * groups, tl.num_programs(0)):
        p = tl.load(sorted_pair_ptr + u // groups)
        if p >= 0:
            p64 = p.to(tl.int64)
            c = (u % groups) * 128 + j
            gate = tl.load(h_ptr + p64 * stride_h + c).to(tl.float32)
            up = tl.load(h_ptr + p64 * stride_h + I + c).to(tl.float32)
            if HAS_LIMIT:
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
            act = gate / (1.0 + tl.exp(-gate)) * up
            payload, scale = quantize_g128(tl.reshape(act, [1, 128]), HW_CVT)
            tl.store(a2_ptr + p64 * stride_a2 + c, tl.reshape(payload, [128]))
            tl.store(s_ptr + p64 * stride_s + u % groups + tl.arange(0, 1), scale * tl.load(route_w_ptr + p64))


@triton.jit
def _row_start(p64, stride_o, dest_ptr, seg_pairs, seg_row_bytes, DEST: tl.constexpr, SHIFT: tl.constexpr):
    """Where pair p's row starts in ``out``, in its elements: row p (DEST 0), or a byte offset from the
    caller (DEST 1: a table per pair; DEST 2: one base per segment of seg_pairs pairs, rows seg_row_bytes
    apart; experts/live.py SegmentDest), shifted to elements of 2**SHIFT bytes."""
    if DEST == 1:
        return tl.load(dest_ptr + p64) >> SHIFT
    elif DEST == 2:
        seg = p64 // seg_pairs
        return (tl.load(dest_ptr + seg) + (p64 - seg * seg_pairs) * seg_row_bytes) >> SHIFT
    else:
        return p64 * stride_o


@triton.jit
def finalize_kernel(
    sorted_pair_ptr, live_tiles_ptr, BM, c_ptr, stride_c, out_ptr, stride_o, dest_ptr, seg_pairs, seg_row_bytes, N,
    OUT_FMT: tl.constexpr, DEST: tl.constexpr, BN: tl.constexpr, HW_CVT: tl.constexpr,
):
    """Pair p of each live layout row, BN columns at a time: c[p] (bf16 [N], route-weighted) -> its row of
    ``out`` in OUT_FMT: "f32", "bf16" (a copy) or "fp8" (the fp8_blockwise_1x32 wire row; ``out`` bytes)."""
    pieces = tl.cdiv(N, BN)
    n0 = tl.arange(0, BN)
    for u in range(tl.program_id(0), tl.load(live_tiles_ptr) * BM * pieces, tl.num_programs(0)):
        p = tl.load(sorted_pair_ptr + u // pieces)
        if p >= 0:
            p64 = p.to(tl.int64)
            n = (u % pieces) * BN + n0
            nm = n < N
            v = tl.load(c_ptr + p64 * stride_c + n, mask=nm, other=0.0)
            if OUT_FMT == "f32":
                tl.store(out_ptr + _row_start(p64, stride_o, dest_ptr, seg_pairs, seg_row_bytes, DEST, 2) + n,
                         v.to(tl.float32), mask=nm)
            elif OUT_FMT == "bf16":
                tl.store(out_ptr + _row_start(p64, stride_o, dest_ptr, seg_pairs, seg_row_bytes, DEST, 1) + n, v, mask=nm)
            else:
                tl.static_assert(OUT_FMT == "fp8", "OUT_FMT must be f32, bf16 or fp8")
                payload, scales = quantize_blocks(tl.reshape(v.to(tl.float32), [BN // 32, 32]), "fp8", HW_CVT)
                row = out_ptr + _row_start(p64, stride_o, dest_ptr, seg_pairs, seg_row_bytes, DEST, 0)
                tl.store(row + n, tl.reshape(payload, [BN]), mask=nm)
                sb = (u % pieces) * (BN // 32) + tl.arange(0, BN // 32)
                tl.store(row + N + sb, scales, mask=sb < N // 32)


__all__ = ["finalize_kernel", "group_rows_kernel", "swiglu_a2_kernel", "swiglu_g128_kernel"]
