"""GEMM2 x route weight, scattered straight back to pair order (fp32 [P, H], or the combine wire).

A2 comes from GEMM1 in expert-sorted order (bf16, MX, or fp8_g128); W2 [E, H, I] is MXFP4, bf16 or block-FP8. The
epilogue multiplies each token column by its pair's route weight and stores the row at the pair's
index, so no unpermute pass and no padded output rows exist. OUT_FMT picks what is stored: "f32"
(the provider's fp32 contract), or the combine wire row the layer sends back (formats/wire.py):
"bf16" (RNE) or "fp8" (``fp8_blockwise_1x32``: e4m3 payload, then one E8M0 scale per 1x32 block
at byte H + n // 32), bit-identical to ``WireFormat.encode`` of the fp32 row. Why: the fp32 rows
are 4 bytes per element written here and read again by the encode (at 8192 tokens x top-6 that is
1.4 GB each way); the wire row is 2 or 1 + 1/32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mainloop import (assume_k_loop_runs, block_fp8_mainloop, claim_tile, frag_tile_mainloop, mx_mainloop, next_item, persistent_items,
                       release_claims)
from .mxjit import round_bf16
from .pdl import pdl_enter
from .quant import quantize_blocks


# the row counts are runtime values, not specialisations: a new batch size of a seen tile config compiles
# nothing (launch_plan: the config alone decides the kernel; layer/device/startup_wait.py relies on it)
@triton.jit(do_not_specialize=["num_m_tiles", "seg_pairs"])
def gemm2_weighted_kernel(
    tile_expert_ptr, sorted_pair_ptr, route_w_ptr, num_m_tiles, live_tiles_ptr, claim_ptr,
    a_ptr, stride_am, as_ptr, stride_asm,
    w_ptr, stride_we, stride_wn, ws_ptr, stride_wse, stride_wsn, wrs_ptr, stride_wrse, ars_ptr,
    out_ptr, stride_om, dest_ptr, seg_pairs, seg_row_bytes,
    K, N,
    W_FMT: tl.constexpr, A_FMT: tl.constexpr,
    DECODE: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    F32_DOT: tl.constexpr, TAIL_M: tl.constexpr, PASS: tl.constexpr, TAIL_RIDE: tl.constexpr, OUT_FMT: tl.constexpr,
    W_FULL: tl.constexpr, DEST: tl.constexpr = 0, PERSIST: tl.constexpr = False, DEST_ALIGN: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    """One tile per program, or PERSIST: a fixed grid claiming the live tiles (live_tiles_ptr) in order (claim_ptr).
    DEST: 0 rows at their pair index, 1 a destination table, 2 a destination per segment (_row_offsets);
    DEST_ALIGN: bytes every DEST 2 row offset is a multiple of (SegmentDest.align). PDL: launched with
    programmatic dependent launch (pdl.py)."""
    pdl_enter(PDL)
    assume_k_loop_runs(K, BK)
    BM_RUN: tl.constexpr = TAIL_M if PASS == "short" else BM  # the short launch runs its tiles' first TAIL_M rows
    RIDE: tl.constexpr = TAIL_M if PASS == "ride" else 0  # rows of the next (short) tile run in this tile's loop
    if PERSIST:
        item, end, m_tiles = persistent_items(live_tiles_ptr, tl.cdiv(N, BN), claim_ptr)
        while item < end:
            expert, row0, pid_n, mine = claim_tile(item, tile_expert_ptr, sorted_pair_ptr, m_tiles, tl.cdiv(N, BN), GROUP_M,
                                                   BM, TAIL_M, PASS, TAIL_RIDE)
            if mine:
                _gemm2_tile(
                    expert, row0, pid_n, sorted_pair_ptr, route_w_ptr, a_ptr, stride_am, as_ptr, stride_asm,
                    w_ptr, stride_we, stride_wn, ws_ptr, stride_wse, stride_wsn, wrs_ptr, stride_wrse, ars_ptr, out_ptr,
                    stride_om, dest_ptr, seg_pairs, seg_row_bytes, K, N, W_FMT, A_FMT, DECODE, USE_ASM, BN, BM_RUN, BK,
                    F32_DOT, RIDE, OUT_FMT, W_FULL, DEST, DEST_ALIGN,
                )
            item = next_item(claim_ptr)
        release_claims(claim_ptr, end)
    else:
        expert, row0, pid_n, mine = claim_tile(tl.program_id(0), tile_expert_ptr, sorted_pair_ptr, num_m_tiles,
                                               tl.cdiv(N, BN), GROUP_M, BM, TAIL_M, PASS, TAIL_RIDE)
        if mine:
            _gemm2_tile(
                expert, row0, pid_n, sorted_pair_ptr, route_w_ptr, a_ptr, stride_am, as_ptr, stride_asm,
                w_ptr, stride_we, stride_wn, ws_ptr, stride_wse, stride_wsn, wrs_ptr, stride_wrse, ars_ptr, out_ptr,
                stride_om, dest_ptr, seg_pairs, seg_row_bytes, K, N, W_FMT, A_FMT, DECODE, USE_ASM, BN, BM_RUN, BK,
                F32_DOT, RIDE, OUT_FMT, W_FULL, DEST, DEST_ALIGN,
            )


@triton.jit
def _gemm2_tile(
    expert, row0, pid_n, sorted_pair_ptr, route_w_ptr, a_ptr, stride_am, as_ptr, stride_asm,
    w_ptr, stride_we, stride_wn, ws_ptr, stride_wse, stride_wsn, wrs_ptr, stride_wrse, ars_ptr, out_ptr, stride_om, dest_ptr,
    seg_pairs, seg_row_bytes, K, N, W_FMT: tl.constexpr, A_FMT: tl.constexpr, DECODE: tl.constexpr, USE_ASM: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr, RIDE: tl.constexpr, OUT_FMT: tl.constexpr,
    W_FULL: tl.constexpr, DEST: tl.constexpr, DEST_ALIGN: tl.constexpr,
):
    """One BN x BM output tile (BM: the tile height, or TAIL_M for a short tile's first rows), and with
    RIDE > 0 the first RIDE rows of the next tile as a rider (frag decoders only)."""
    rows = row0 + tl.arange(0, BM)
    pair = tl.load(sorted_pair_ptr + rows)
    valid = pair >= 0  # padding rows of the tile: A2 never read, nothing stored
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < N
    e64 = expert.to(tl.int64)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if DECODE == "frag" or DECODE == "frag8":
        acc, acc_r, _, r_pair = frag_tile_mainloop(
            acc, w_ptr + e64 * stride_we, ws_ptr + e64 * stride_wse, wrs_ptr + e64 * stride_wrse, pid_n * (BN // 16),
            N // 16, a_ptr, row0, rows, valid, stride_am, ars_ptr, K, sorted_pair_ptr,
            DECODE, USE_ASM, BN, BM, BK, F32_DOT, RIDE, False, W_FULL,
        )
    elif DECODE == "block_fp8":
        tl.static_assert(RIDE == 0, "tail riders need a fragment decoder (frag / frag8)")
        acc = block_fp8_mainloop(
            acc, w_ptr + e64 * stride_we, n, nmask, stride_wn, ws_ptr + e64 * stride_wse, stride_wsn,
            a_ptr, rows, valid, stride_am, as_ptr, stride_asm, K, BK, F32_DOT,
        )
    else:
        tl.static_assert(RIDE == 0, "tail riders need a fragment decoder (frag / frag8)")
        acc = mx_mainloop(
            acc,
            w_ptr + e64 * stride_we, n, nmask, stride_wn, ws_ptr + e64 * stride_wse, stride_wsn,
            a_ptr, rows, valid, stride_am, as_ptr, stride_asm,
            K, W_FMT, A_FMT, DECODE, USE_ASM, BN, BM, BK, F32_DOT,
        )
    _gemm2_store(acc, pair, pid_n, route_w_ptr, out_ptr, stride_om, dest_ptr, seg_pairs, seg_row_bytes, N, BN, OUT_FMT,
                 USE_ASM, DEST, DEST_ALIGN)
    if RIDE > 0:
        _gemm2_store(acc_r, r_pair, pid_n, route_w_ptr, out_ptr, stride_om, dest_ptr, seg_pairs, seg_row_bytes, N, BN,
                     OUT_FMT, USE_ASM, DEST, DEST_ALIGN)


@triton.jit
def _row_offsets(pair, valid, stride_om, dest_ptr, seg_pairs, seg_row_bytes, DEST: tl.constexpr, SHIFT: tl.constexpr,
                 DEST_ALIGN: tl.constexpr = 1):
    """Where each pair's row starts, in elements of ``out``: at its pair index (``pair * stride_om``),
    or where the caller says, in int64 byte offsets from ``out`` (e.g. the source rank's combine
    region in a peer arena; the kernel knows no ranks): DEST 1 a table per pair, DEST 2 one base per
    segment of seg_pairs pairs, rows seg_row_bytes apart (experts/live.py SegmentDest).

    DEST 2 offsets come from a load, so the compiler cannot see their alignment: without DEST_ALIGN it
    stores element by element with a 64-bit address each, which spilled GEMM2's epilogue (sm_90a, mid
    tile: 4512 bytes); with the caller's promise (SegmentDest.align) the stores are 16-byte vectors, as
    at a pair index."""
    if DEST == 1:
        return tl.load(dest_ptr + pair, mask=valid, other=0) >> SHIFT
    elif DEST == 2:  # int32 division (pair indices fit): a 64-bit one is a long emulated sequence per row
        seg = pair // seg_pairs
        within = (pair - seg * seg_pairs).to(tl.int64)
        return _known_multiple((tl.load(dest_ptr + seg, mask=valid, other=0) + within * seg_row_bytes) >> SHIFT,
                               DEST_ALIGN >> SHIFT)
    else:
        return pair.to(tl.int64) * stride_om


@triton.jit
def _known_multiple(x, M: tl.constexpr):
    """``x`` (whose values are multiples of M, a power of two) written so the compiler sees it: a multiply
    by a constant survives its alignment analysis through reshape / split, where tl.multiple_of on a
    split's result is dropped (the fp8 wire stores its even / odd rows apart)."""
    if M > 1:
        return x // M * M
    return x


@triton.jit
def _gemm2_store(acc, pair, pid_n, route_w_ptr, out_ptr, stride_om, dest_ptr, seg_pairs, seg_row_bytes, N, BN: tl.constexpr,
                 OUT_FMT: tl.constexpr, HW_CVT: tl.constexpr, DEST: tl.constexpr, DEST_ALIGN: tl.constexpr = 1):
    """acc [BN, rows] x each row's route weight -> rows of ``out`` at the pairs' indices (padding: -1,
    skipped): fp32, or the combine wire row (OUT_FMT "bf16" / "fp8", module docstring)."""
    valid = pair >= 0
    wt = tl.load(route_w_ptr + pair, mask=valid, other=0.0)
    out = acc * wt[None, :]
    n = pid_n * BN + tl.arange(0, BN)
    mask = valid[None, :] & (n < N)[:, None]
    if OUT_FMT == "f32":
        ro = _row_offsets(pair, valid, stride_om, dest_ptr, seg_pairs, seg_row_bytes, DEST, 2, DEST_ALIGN)[None, :]
        tl.store(out_ptr + ro + n[:, None], out, mask=mask)
    elif OUT_FMT == "bf16":  # integer RNE (the interpreter truncates fp32 -> bf16 casts), then an exact cast
        ro = _row_offsets(pair, valid, stride_om, dest_ptr, seg_pairs, seg_row_bytes, DEST, 1, DEST_ALIGN)[None, :]
        tl.store(out_ptr + ro + n[:, None], round_bf16(out).to(tl.bfloat16), mask=mask)
    else:
        tl.static_assert(OUT_FMT == "fp8", "OUT_FMT must be f32, bf16 or fp8")
        tl.static_assert(BN % 32 == 0, "the fp8 combine wire quantises 1x32 blocks of the tile's columns")
        rows: tl.constexpr = acc.shape[1]
        # a destination's row offsets (a load, a division) once, in the pairs' own layout; the plain pair
        # index (DEST 0, one multiply) is cheaper recomputed in each half's layout (ep_size 1: measured)
        ro = _row_offsets(pair, valid, stride_om, dest_ptr, seg_pairs, seg_row_bytes, DEST, 0, DEST_ALIGN) if DEST else pair
        if rows >= 32:  # even / odd token columns apart (in-thread pairs of the MMA layout): half the transpose at a time
            ev, od = tl.split(tl.reshape(out, [BN, rows // 2, 2]))
            pe, po = tl.split(tl.reshape(pair, [rows // 2, 2]))
            re, rod = tl.split(tl.reshape(ro, [rows // 2, 2]))
            _store_fp8_rows(ev, pe, re, pid_n, out_ptr, stride_om, N, BN, HW_CVT, DEST, DEST_ALIGN)
            _store_fp8_rows(od, po, rod, pid_n, out_ptr, stride_om, N, BN, HW_CVT, DEST, DEST_ALIGN)
        else:
            _store_fp8_rows(out, pair, ro, pid_n, out_ptr, stride_om, N, BN, HW_CVT, DEST, DEST_ALIGN)


@triton.jit
def _store_fp8_rows(out, pair, row_offset, pid_n, out_ptr, stride_om, N, BN: tl.constexpr, HW_CVT: tl.constexpr,
                    DEST: tl.constexpr, DEST_ALIGN: tl.constexpr = 1):
    """out [BN, rows] (route-weighted) -> fp8_blockwise_1x32 wire rows at ``row_offset`` (bytes, _row_offsets),
    or with DEST 0 at the pairs' indices. The split into even / odd rows loses what _row_offsets told the
    compiler of their alignment, so it is said again here (DEST_ALIGN, _known_multiple)."""
    rows: tl.constexpr = out.shape[1]
    n = pid_n * BN + tl.arange(0, BN)
    valid = pair >= 0
    payload, scales = quantize_blocks(tl.reshape(tl.trans(out), [rows * (BN // 32), 32]), "fp8", HW_CVT)
    if DEST:
        ro = (_known_multiple(row_offset, DEST_ALIGN) if DEST == 2 else row_offset)[:, None]
    else:
        ro = pair.to(tl.int64)[:, None] * stride_om
    tl.store(out_ptr + ro + n[None, :], tl.reshape(payload, [rows, BN]), mask=valid[:, None] & (n < N)[None, :])
    sc = pid_n * (BN // 32) + tl.arange(0, BN // 32)
    tl.store(out_ptr + ro + N + sc[None, :], tl.reshape(scales, [rows, BN // 32]),
             mask=valid[:, None] & (sc < N // 32)[None, :])
