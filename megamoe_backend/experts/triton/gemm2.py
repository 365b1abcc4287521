"""GEMM2 x route weight, scattered straight back to pair order (fp32 [P, H]).

A2 comes from GEMM1 in expert-sorted order (bf16 or MX); W2 [E, H, I] is MXFP4 or bf16. The
epilogue multiplies each token column by its pair's route weight and stores the fp32 row at the
pair's index, so no unpermute pass and no padded output rows exist.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mainloop import assume_k_loop_runs, claim_tile, frag_tile_mainloop, mx_mainloop


@triton.jit
def gemm2_weighted_kernel(
    tile_expert_ptr, sorted_pair_ptr, route_w_ptr, num_m_tiles,
    a_ptr, stride_am, as_ptr, stride_asm,
    w_ptr, stride_we, stride_wn, ws_ptr, stride_wse, stride_wsn, wrs_ptr, stride_wrse, ars_ptr,
    out_ptr, stride_om,
    K, N,
    W_FMT: tl.constexpr, A_FMT: tl.constexpr,
    DECODE: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    F32_DOT: tl.constexpr, TAIL_M: tl.constexpr, PASS: tl.constexpr, TAIL_RIDE: tl.constexpr,
):
    expert, row0, pid_n, mine = claim_tile(tile_expert_ptr, sorted_pair_ptr, num_m_tiles, tl.cdiv(N, BN), GROUP_M, BM, TAIL_M,
                                           PASS, TAIL_RIDE)
    if not mine:
        return
    assume_k_loop_runs(K, BK)
    BM_RUN: tl.constexpr = TAIL_M if PASS == "short" else BM  # the short launch runs its tiles' first TAIL_M rows
    RIDE: tl.constexpr = TAIL_M if PASS == "ride" else 0  # rows of the next (short) tile run in this tile's loop
    _gemm2_tile(
        expert, row0, pid_n, sorted_pair_ptr, route_w_ptr, a_ptr, stride_am, as_ptr, stride_asm,
        w_ptr, stride_we, stride_wn, ws_ptr, stride_wse, stride_wsn, wrs_ptr, stride_wrse, ars_ptr, out_ptr, stride_om,
        K, N, W_FMT, A_FMT, DECODE, USE_ASM, BN, BM_RUN, BK, F32_DOT, RIDE,
    )


@triton.jit
def _gemm2_tile(
    expert, row0, pid_n, sorted_pair_ptr, route_w_ptr, a_ptr, stride_am, as_ptr, stride_asm,
    w_ptr, stride_we, stride_wn, ws_ptr, stride_wse, stride_wsn, wrs_ptr, stride_wrse, ars_ptr, out_ptr, stride_om, K, N,
    W_FMT: tl.constexpr, A_FMT: tl.constexpr, DECODE: tl.constexpr, USE_ASM: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr, RIDE: tl.constexpr,
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
            DECODE, USE_ASM, BN, BM, BK, F32_DOT, RIDE, False,
        )
    else:
        tl.static_assert(RIDE == 0, "tail riders need a fragment decoder (frag / frag8)")
        acc = mx_mainloop(
            acc,
            w_ptr + e64 * stride_we, n, nmask, stride_wn, ws_ptr + e64 * stride_wse, stride_wsn,
            a_ptr, rows, valid, stride_am, as_ptr, stride_asm,
            K, W_FMT, A_FMT, DECODE, USE_ASM, BN, BM, BK, F32_DOT,
        )
    _gemm2_store(acc, pair, n, route_w_ptr, out_ptr, stride_om, N)
    if RIDE > 0:
        _gemm2_store(acc_r, r_pair, n, route_w_ptr, out_ptr, stride_om, N)


@triton.jit
def _gemm2_store(acc, pair, n, route_w_ptr, out_ptr, stride_om, N):
    """acc [BN, rows] x each row's route weight -> fp32 rows of ``out`` at the pairs' indices (padding: -1, skipped)."""
    valid = pair >= 0
    wt = tl.load(route_w_ptr + pair, mask=valid, other=0.0)
    out = acc * wt[None, :]
    p64 = pair.to(tl.int64)[None, :]
    tl.store(out_ptr + p64 * stride_om + n[:, None], out, mask=valid[None, :] & (n < N)[:, None])
