"""GEMM1 + SwiGLU (+ clamp limit) + re-quantisation of A2 to the A format, per expert tile.

Reads A rows straight from the received rows (layout.sorted_row: each sorted row's received row; MX
rows converted once per received row by gather.py for the split / frag / frag8 decoders, never
copied per pair), W1 [E, 2I, H] as MXFP4 (packed, never expanded in memory), bf16, or block-FP8 (e4m3 in
128 x 128 blocks with fp32 scales, A in 1 x 128 groups: DECODE "block_fp8"). Each program owns BN
consecutive GEMM1 output rows in gate/up INTERLEAVED order; for the plain layout the weight rows are
gathered into that order on load, so the epilogue is the same for both. Output A2 is written in
expert-sorted row order: bf16, MX data + E8M0 scales bit-identical to formats.quantize_mx, or (A_FMT
"fp8_g128") e4m3 + one fp32 scale per 1 x 128 group with formats.block_fp8.quantize_groups' rule; a block-FP8
tile's BN / 2 columns are whole groups (config.BLOCK_FP8_BUCKETS: BN 256).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mainloop import (assume_k_loop_runs, block_fp8_mainloop, claim_tile, frag_tile_mainloop, mx_mainloop, next_item, persistent_items,
                       release_claims)
from .mxjit import fake_quant_blocks, round_bf16
from .pdl import pdl_enter
from .quant import quantize_blocks, quantize_g128


# the row counts are runtime values, not specialisations: a new batch size of a seen tile config compiles
# nothing (launch_plan: the config alone decides the kernel; layer/device/startup_wait.py relies on it)
@triton.jit(do_not_specialize=["num_m_tiles"])
def gemm1_swiglu_kernel(
    tile_expert_ptr, sorted_row_ptr, num_m_tiles, live_tiles_ptr, claim_ptr,
    a_ptr, stride_am, as_ptr, stride_asm,
    w_ptr, stride_we, stride_wn, ws_ptr, stride_wse, stride_wsn, wrs_ptr, stride_wrse, ars_ptr,
    o_ptr, stride_om, os_ptr, stride_osm,
    K, I, limit,
    W_FMT: tl.constexpr, A_FMT: tl.constexpr, PLAIN: tl.constexpr, HAS_LIMIT: tl.constexpr,
    DECODE: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, F32_DOT: tl.constexpr, BK2: tl.constexpr, TAIL_M: tl.constexpr, PASS: tl.constexpr,
    TAIL_RIDE: tl.constexpr, W_FULL: tl.constexpr, PERSIST: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """One tile per program, or PERSIST: a fixed grid claiming the live tiles (live_tiles_ptr) in order (claim_ptr).
    PDL: launched with programmatic dependent launch (pdl.py)."""
    pdl_enter(PDL)
    assume_k_loop_runs(K, BK)
    BM_RUN: tl.constexpr = TAIL_M if PASS == "short" else BM  # the short launch runs its tiles' first TAIL_M rows
    RIDE: tl.constexpr = TAIL_M if PASS == "ride" else 0  # rows of the next (short) tile run in this tile's loop
    if PERSIST:
        item, end, m_tiles = persistent_items(live_tiles_ptr, tl.cdiv(2 * I, BN), claim_ptr)
        while item < end:
            expert, row0, pid_n, mine = claim_tile(item, tile_expert_ptr, sorted_row_ptr, m_tiles, tl.cdiv(2 * I, BN),
                                                   GROUP_M, BM, TAIL_M, PASS, TAIL_RIDE)
            if mine:
                _gemm1_tile(
                    expert, row0, pid_n, sorted_row_ptr, a_ptr, stride_am, as_ptr, stride_asm,
                    w_ptr, stride_we, stride_wn, ws_ptr, stride_wse, stride_wsn, wrs_ptr, stride_wrse, ars_ptr,
                    o_ptr, stride_om, os_ptr, stride_osm, K, I, limit,
                    W_FMT, A_FMT, PLAIN, HAS_LIMIT, DECODE, USE_ASM, BN, BM_RUN, BK, F32_DOT, BK2, RIDE, W_FULL,
                )
            item = next_item(claim_ptr)
        release_claims(claim_ptr, end)
    else:
        expert, row0, pid_n, mine = claim_tile(tl.program_id(0), tile_expert_ptr, sorted_row_ptr, num_m_tiles,
                                               tl.cdiv(2 * I, BN), GROUP_M, BM, TAIL_M, PASS, TAIL_RIDE)
        if mine:
            _gemm1_tile(
                expert, row0, pid_n, sorted_row_ptr, a_ptr, stride_am, as_ptr, stride_asm,
                w_ptr, stride_we, stride_wn, ws_ptr, stride_wse, stride_wsn, wrs_ptr, stride_wrse, ars_ptr,
                o_ptr, stride_om, os_ptr, stride_osm, K, I, limit,
                W_FMT, A_FMT, PLAIN, HAS_LIMIT, DECODE, USE_ASM, BN, BM_RUN, BK, F32_DOT, BK2, RIDE, W_FULL,
            )


@triton.jit
def _gemm1_tile(
    expert, row0, pid_n, sorted_row_ptr, a_ptr, stride_am, as_ptr, stride_asm,
    w_ptr, stride_we, stride_wn, ws_ptr, stride_wse, stride_wsn, wrs_ptr, stride_wrse, ars_ptr,
    o_ptr, stride_om, os_ptr, stride_osm, K, I, limit,
    W_FMT: tl.constexpr, A_FMT: tl.constexpr, PLAIN: tl.constexpr, HAS_LIMIT: tl.constexpr,
    DECODE: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    F32_DOT: tl.constexpr, BK2: tl.constexpr, RIDE: tl.constexpr, W_FULL: tl.constexpr,
):
    """One BN x BM tile of GEMM1 + epilogue (BM: the tile height, or TAIL_M for a short tile), and
    with RIDE > 0 the first RIDE rows of the next tile as a rider (frag decoders only)."""
    rows = row0 + tl.arange(0, BM)
    a_rows = tl.load(sorted_row_ptr + rows)  # A is per received row (gather.py), any decoder
    valid = a_rows >= 0  # padding rows of the tile are masked: their A is never read (L2 traffic at decode)
    a_rows = tl.where(valid, a_rows, 0)

    n = pid_n * BN + tl.arange(0, BN)  # interleaved GEMM1 output index: 2 * i + (0 gate | 1 up)
    if PLAIN:
        w_rows = n // 2 + (n % 2) * I
    else:
        w_rows = n
    e64 = expert.to(tl.int64)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if DECODE == "frag" or DECODE == "frag8":  # fragment storage: W1 is always gate/up interleaved (fragments.py)
        acc, acc_r, r_rows, _ = frag_tile_mainloop(
            acc, w_ptr + e64 * stride_we, ws_ptr + e64 * stride_wse, wrs_ptr + e64 * stride_wrse, pid_n * (BN // 16),
            (2 * I) // 16, a_ptr, row0, a_rows, valid, stride_am, ars_ptr, K, sorted_row_ptr,
            DECODE, USE_ASM, BN, BM, BK, F32_DOT, RIDE, True, W_FULL,
        )
    elif DECODE == "block_fp8":
        tl.static_assert(RIDE == 0, "tail riders need a fragment decoder (frag / frag8)")
        acc = block_fp8_mainloop(
            acc, w_ptr + e64 * stride_we, w_rows, n < 2 * I, stride_wn, ws_ptr + e64 * stride_wse, stride_wsn,
            a_ptr, a_rows, valid, stride_am, as_ptr, stride_asm, K, BK, F32_DOT,
        )
    else:
        tl.static_assert(RIDE == 0, "tail riders need a fragment decoder (frag / frag8)")
        acc = mx_mainloop(
            acc,
            w_ptr + e64 * stride_we, w_rows, n < 2 * I, stride_wn, ws_ptr + e64 * stride_wse, stride_wsn,
            a_ptr, a_rows, valid, stride_am, as_ptr, stride_asm,
            K, W_FMT, A_FMT, DECODE, USE_ASM, BN, BM, BK, F32_DOT,
        )
    _gemm1_store(acc, rows, pid_n, o_ptr, stride_om, os_ptr, stride_osm, I, limit, A_FMT, HAS_LIMIT, DECODE, BN, BM, BK2, USE_ASM)
    if RIDE > 0:
        _gemm1_store(acc_r, r_rows, pid_n, o_ptr, stride_om, os_ptr, stride_osm, I, limit, A_FMT, HAS_LIMIT, DECODE, BN, RIDE, BK2,
                     USE_ASM)


@triton.jit
def _gemm1_store(
    acc, rows, pid_n, o_ptr, stride_om, os_ptr, stride_osm, I, limit,
    A_FMT: tl.constexpr, HAS_LIMIT: tl.constexpr, DECODE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK2: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """Epilogue of acc [BN, BM] (sorted rows ``rows``): SwiGLU (+ clamp), A2 in the A format (HW_CVT: fp8
    bytes by the GPU's conversion, quant.quantize_blocks)."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, [BN // 2, 2, BM]), (0, 2, 1)))
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = tl.trans(gate / (1.0 + tl.exp(-gate)) * up)  # [BM, BN // 2]

    r64 = rows.to(tl.int64)[:, None]
    cols = pid_n * (BN // 2) + tl.arange(0, BN // 2)
    cmask = (cols < I)[None, :]
    if DECODE == "split" or DECODE == "frag":  # A2 as fake-quantised bf16 (split: BK2 blocks stored [even | odd])
        if A_FMT == "bf16":
            v = round_bf16(act)
        else:
            v = tl.reshape(fake_quant_blocks(tl.reshape(act, [BM * (BN // 64), 32]), A_FMT), [BM, BN // 2])
        if DECODE == "split":
            rem = cols % BK2
            dest = cols - rem + tl.where(rem % 2 == 0, rem // 2, BK2 // 2 + rem // 2)
        else:
            dest = cols
        tl.store(o_ptr + r64 * stride_om + dest[None, :], v.to(tl.bfloat16), mask=cmask)
    elif A_FMT == "bf16":
        tl.store(o_ptr + r64 * stride_om + cols[None, :], round_bf16(act).to(tl.bfloat16), mask=cmask)
    elif A_FMT == "fp8_g128":  # whole 1 x 128 groups of A2 per tile (BN % 256 == 0: checks.check_candidates)
        GROUPS: tl.constexpr = BN // 256
        payload, scales = quantize_g128(tl.reshape(act, [BM * GROUPS, 128]), HW_CVT)
        g = pid_n * GROUPS + tl.arange(0, GROUPS)
        tl.store(os_ptr + r64 * stride_osm + g[None, :], tl.reshape(scales, [BM, GROUPS]), mask=(g < I // 128)[None, :])
        tl.store(o_ptr + r64 * stride_om + cols[None, :], tl.reshape(payload, [BM, BN // 2]), mask=cmask)
    else:
        payload, scales = quantize_blocks(tl.reshape(act, [BM * (BN // 64), 32]), A_FMT, HW_CVT)
        sc = pid_n * (BN // 64) + tl.arange(0, BN // 64)
        tl.store(os_ptr + r64 * stride_osm + sc[None, :], tl.reshape(scales, [BM, BN // 64]), mask=(sc < I // 32)[None, :])
        if A_FMT == "fp8":
            tl.store(o_ptr + r64 * stride_om + cols[None, :], tl.reshape(payload, [BM, BN // 2]), mask=cmask)
        else:
            c4 = pid_n * (BN // 4) + tl.arange(0, BN // 4)
            tl.store(o_ptr + r64 * stride_om + c4[None, :], tl.reshape(payload, [BM, BN // 4]), mask=(c4 < I // 2)[None, :])
