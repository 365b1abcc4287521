"""The K loop shared by GEMM1 and GEMM2: acc[BN, BM] += W[BN, K] @ A[BM, K]^T, one expert.

Swap-AB orientation: the weight rows fill the MMA's M side (>= 64 rows per tile) and the few tokens
an expert gets at decode fill its N side (>= 16), so small token tiles waste no tensor-core rows;
the weight operand is the one that is decoded in registers.

Decoders, chosen by the constexpr DECODE (the fragment ones share frag_mainloop below):
- "frag8" (frag_mainloop; the H200 default for A8W4 / A4W4): FP8 MMA on e4m3 weights decoded from
  fragment-ordered words by PRMT table lookups with the block scales folded in, and e4m3 activations
  over one scale per row; both row scales are applied after the loop. Not exact: the FP8 tensor core adds
  products with fewer bits than fp32 (relL2 ~1e-2 vs exact at K = 7168, docs/triton.md).
- "frag" (frag_mainloop; bf16 activations): bf16 MMA on weights decoded from bf16-fragment words.
- "split" (row-major weights): A arrives pre-dequantised to bf16 with every BK block stored as
  [even K elements | odd K elements] (gather.py / GEMM1's epilogue write it so), W's packed bytes are
  decoded by an 8-values-per-call PTX sequence (mxjit.decode_fp4_split, USE_ASM) into a low-nibble
  and a high-nibble tile, and two bf16 MMAs consume them: no register shuffles, every load contiguous
  and software-pipelined. With USE_ASM=False the same decode runs through portable helpers
  (interpreter).
- "dot_scaled": ``tl.dot_scaled`` (Triton's own upcast on Hopper; native MX MMA on Blackwell).
- "manual": explicit decode of W and of MX A in Triton, two MMAs over even / odd K (stride-2 loads).
- "block_fp8" (block_fp8_mainloop; block-FP8 weights, fp8_g128 A): FP8 MMA of one 128 x 128 weight block
  against one 1 x 128 A group per K step, the step's sum times both fp32 scales added to the fp32
  accumulator (vLLM's Triton fused_moe block-FP8 kernel does the same). Not exact on the GPU (the FP8 tensor
  core's sums within a step); the interpreter's step sums are exact (fp64 dot of e4m3 values).
All but frag8 and block_fp8 are exact: e2m1 / e4m3 values times a power-of-two scale are representable in bf16.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mxjit import (
    SPLIT_UNSCALE,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    decode_fp4_frag,
    decode_fp4_frag8,
    decode_fp4_split,
    scale_bf16_shifted,
)
from .. import fragments

_LUT_LO = tl.constexpr(fragments.FP8_LUT_LO)
_LUT_HI = tl.constexpr(fragments.FP8_LUT_HI)


@triton.jit
def _decode_w_half(packed, s, HIGH: tl.constexpr):
    codes = (packed >> 4) if HIGH else packed
    return (decode_e2m1(codes) * s).to(tl.bfloat16)


@triton.jit
def _mma(w, a, acc, F32_DOT: tl.constexpr):
    """bf16 MMA with fp32 accumulation; F32_DOT widens first (the interpreter's dot cannot do bf16)."""
    if F32_DOT:
        return tl.dot(w.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, a, acc)


@triton.jit
def mx_mainloop(
    acc,
    w_ptr, w_rows, w_mask, stride_wn, ws_ptr, stride_wsn,
    a_ptr, a_rows, a_mask, stride_am, as_ptr, stride_asm,
    K,
    W_FMT: tl.constexpr, A_FMT: tl.constexpr, DECODE: tl.constexpr, USE_ASM: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr,
):
    """w_ptr / ws_ptr point at this expert's [N, K(/2)] weights / [N, K/32] scales; a_rows are rows of A."""
    wr = w_rows.to(tl.int64)[:, None]
    ar = a_rows.to(tl.int64)[None, :]
    wm = w_mask[:, None]
    am = a_mask[None, :]
    if DECODE == "split":  # W mxfp4, A bf16 split per BK block
        j = tl.arange(0, BK // 2)
        ks = tl.arange(0, BK // 32)
        for k0 in range(0, K, BK):
            packed = tl.load(w_ptr + wr * stride_wn + (k0 // 2 + j)[None, :], mask=wm, other=0)
            sc = scale_bf16_shifted(tl.load(ws_ptr + wr * stride_wsn + (k0 // 32 + ks)[None, :], mask=wm, other=127))
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BN, BK // 32, 16]), [BN, BK // 2])
            w_lo, w_hi = decode_fp4_split(packed, sc, USE_ASM)
            a_lo = tl.load(a_ptr + ar * stride_am + (k0 + j)[:, None], mask=am, other=0.0)
            a_hi = tl.load(a_ptr + ar * stride_am + (k0 + BK // 2 + j)[:, None], mask=am, other=0.0)
            acc = _mma(w_lo, a_lo, acc, F32_DOT)
            acc = _mma(w_hi, a_hi, acc, F32_DOT)
        acc = acc * SPLIT_UNSCALE
    elif DECODE == "dot_scaled":
        kk = tl.arange(0, BK)
        k2 = tl.arange(0, BK // 2)
        ks = tl.arange(0, BK // 32)
        for k0 in range(0, K, BK):
            if W_FMT == "mxfp4":
                w = tl.load(w_ptr + wr * stride_wn + (k0 // 2 + k2)[None, :], mask=wm, other=0)
                ws = tl.load(ws_ptr + wr * stride_wsn + (k0 // 32 + ks)[None, :], mask=wm, other=127)
            else:
                w = tl.load(w_ptr + wr * stride_wn + (k0 + kk)[None, :], mask=wm, other=0.0)
            if A_FMT == "fp4":
                a = tl.load(a_ptr + ar * stride_am + (k0 // 2 + k2)[:, None], mask=am, other=0)
            else:
                a = tl.load(a_ptr + ar * stride_am + (k0 + kk)[:, None], mask=am, other=0.0)
            if A_FMT != "bf16":
                a_s = tl.load(as_ptr + a_rows.to(tl.int64)[:, None] * stride_asm + (k0 // 32 + ks)[None, :],
                              mask=a_mask[:, None], other=127)
            if W_FMT == "mxfp4":
                if A_FMT == "bf16":
                    acc = tl.dot_scaled(w, ws, "e2m1", a, None, "bf16", acc)
                elif A_FMT == "fp8":
                    acc = tl.dot_scaled(w, ws, "e2m1", a, a_s, "e4m3", acc)
                else:
                    acc = tl.dot_scaled(w, ws, "e2m1", a, a_s, "e2m1", acc)
            else:
                if A_FMT == "bf16":
                    acc = tl.dot(w, a, acc)
                elif A_FMT == "fp8":
                    acc = tl.dot_scaled(w, None, "bf16", a, a_s, "e4m3", acc)
                else:
                    acc = tl.dot_scaled(w, None, "bf16", a, a_s, "e2m1", acc)
    else:
        j = tl.arange(0, BK // 2)
        for k0 in range(0, K, BK):
            kev = k0 + 2 * j  # even K element of each pair
            if W_FMT == "mxfp4":
                packed = tl.load(w_ptr + wr * stride_wn + (k0 // 2 + j)[None, :], mask=wm, other=0)
                s = decode_e8m0(tl.load(ws_ptr + wr * stride_wsn + (kev // 32)[None, :], mask=wm, other=127))
                w_lo = _decode_w_half(packed, s, False)
                w_hi = _decode_w_half(packed, s, True)
            else:
                w_lo = tl.load(w_ptr + wr * stride_wn + kev[None, :], mask=wm, other=0.0)
                w_hi = tl.load(w_ptr + wr * stride_wn + (kev + 1)[None, :], mask=wm, other=0.0)
            if A_FMT == "bf16":
                a_lo = tl.load(a_ptr + ar * stride_am + kev[:, None], mask=am, other=0.0).to(tl.bfloat16)
                a_hi = tl.load(a_ptr + ar * stride_am + (kev + 1)[:, None], mask=am, other=0.0).to(tl.bfloat16)
            else:
                sa = decode_e8m0(tl.load(as_ptr + ar * stride_asm + (kev // 32)[:, None], mask=am, other=127))
                if A_FMT == "fp8":
                    b_lo = tl.load(a_ptr + ar * stride_am + kev[:, None], mask=am, other=0)
                    b_hi = tl.load(a_ptr + ar * stride_am + (kev + 1)[:, None], mask=am, other=0)
                    a_lo = (decode_e4m3(b_lo) * sa).to(tl.bfloat16)
                    a_hi = (decode_e4m3(b_hi) * sa).to(tl.bfloat16)
                else:
                    b = tl.load(a_ptr + ar * stride_am + (k0 // 2 + j)[:, None], mask=am, other=0)
                    a_lo = (decode_e2m1(b) * sa).to(tl.bfloat16)
                    a_hi = (decode_e2m1(b >> 4) * sa).to(tl.bfloat16)
            acc = _mma(w_lo, a_lo, acc, F32_DOT)
            acc = _mma(w_hi, a_hi, acc, F32_DOT)
    return acc


@triton.jit
def block_fp8_mainloop(
    acc,
    w_ptr, w_rows, w_mask, stride_wn, ws_ptr, stride_wsn,
    a_ptr, a_rows, a_mask, stride_am, as_ptr, stride_asm,
    K, BK: tl.constexpr, F32_DOT: tl.constexpr,
):
    """acc[BN, BM] += sum over K steps of (W[w_rows, step] @ A[a_rows, step]^T) * w_scale[block(w_rows), step]
    * a_scale[a_rows, step]: w_ptr / ws_ptr point at this expert's e4m3 [N, K] / fp32 [N / 128, K / 128];
    A is e4m3 [rows, K] with fp32 scales [rows, K / 128]. BK == 128 (one weight block and one A group per step:
    config.BLOCK_FP8_GROUP), so each step's sum is scaled once, outside the MMA.

    The bytes are typed float8e4nv on the GPU (loads land in the MMA's layout); under the interpreter they are
    uint8 (F32_DOT): decoded exactly and summed in fp64 (exact for 128 e4m3 products), then rounded to fp32."""
    wr = w_rows.to(tl.int64)[:, None]
    ar = a_rows.to(tl.int64)[None, :]
    wm = w_mask[:, None]
    am = a_mask[None, :]
    wsr = (w_rows // BK).to(tl.int64) * stride_wsn  # the weight block row of each weight row (128 rows a block)
    asr = a_rows.to(tl.int64) * stride_asm
    kk = tl.arange(0, BK)
    for k0 in range(0, K, BK):
        w = tl.load(w_ptr + wr * stride_wn + (k0 + kk)[None, :], mask=wm, other=0.0)
        a = tl.load(a_ptr + ar * stride_am + (k0 + kk)[:, None], mask=am, other=0.0)
        w_s = tl.load(ws_ptr + wsr + k0 // BK, mask=w_mask, other=0.0)
        a_s = tl.load(as_ptr + asr + k0 // BK, mask=a_mask, other=0.0)
        if F32_DOT:
            step = tl.dot(decode_e4m3(w).to(tl.float64), decode_e4m3(a).to(tl.float64), input_precision="ieee").to(tl.float32)
        else:
            step = tl.dot(w, a)
        acc += step * w_s[:, None] * a_s[None, :]
    return acc


@triton.jit
def assume_k_loop_runs(K, BK: tl.constexpr):
    """Tell the compiler the K loop runs at least once (true: BK is shrunk to divide K, K >= 32).
    Without it LLVM may keep a zero-trip path that writes the accumulators, and ptxas then
    serialises every wgmma of the loop (info C7515): frag GEMM1 did so at commit ce681ac, split
    GEMM1 / GEMM2 up to 8873e5a. Called by both GEMM kernels before any mainloop; tests/kernels/test_sass.py
    checks the compiled loops."""
    tl.assume(K >= BK)


@triton.jit
def claim_tile(pid, tile_expert_ptr, sorted_ptr, num_m_tiles, num_n_tiles, GROUP_M: tl.constexpr, BM: tl.constexpr,
               TAIL_M: tl.constexpr, PASS: tl.constexpr, TAIL_RIDE: tl.constexpr):
    """(expert, first sorted row, N tile, whether this launch runs the tile) of work item ``pid`` (the
    program id, or a persistent program's current item: persistent_items).

    Unused tiles (expert -1) are nobody's. sorted_ptr: per sorted row a value that is -1 on padding
    rows (layout.sorted_pair or sorted_row). With TAIL_M > 0 a tile is "short" when its rows from
    TAIL_M on are all padding (an expert's rows fill its tiles from the top, layout.py, so one look
    at row TAIL_M decides), and the provider launches each GEMM once per PASS:
    - "full": the tiles that are not short (and, with TAIL_RIDE, carry no rider), at height BM;
    - "short": the short tiles (with TAIL_RIDE: only those of an expert with no earlier tile), at
      height TAIL_M;
    - "ride" (TAIL_RIDE): a full tile whose expert's next tile is short runs that tile's TAIL_M rows
      as a rider, in the same K loop on the same decoded weights (frag_mainloop_ride).
    Why: a prefill expert's last tile is often nearly empty; a full-height MMA over it is mostly
    padding, and a short tile of its own still decodes every weight again (docs/triton.md)."""
    pid_m, pid_n = tile_coords(pid, num_m_tiles, num_n_tiles, GROUP_M)
    expert = tl.load(tile_expert_ptr + pid_m)
    row0 = pid_m * BM
    mine = expert >= 0
    if TAIL_M > 0:
        short = tl.load(sorted_ptr + row0 + TAIL_M) < 0
        if TAIL_RIDE:
            has_next = pid_m + 1 < num_m_tiles
            nxt = tl.load(tile_expert_ptr + pid_m + 1, mask=has_next, other=-1)
            next_short = tl.load(sorted_ptr + row0 + BM + TAIL_M, mask=has_next, other=-1) < 0
            carries = (nxt == expert) & next_short
            prev = tl.load(tile_expert_ptr + pid_m - 1, mask=pid_m > 0, other=-1)
            rides = short & (prev == expert)
            if PASS == "full":
                mine = mine & ~short & ~carries
            elif PASS == "short":
                mine = mine & short & ~rides
            else:
                mine = mine & carries
        else:
            mine = mine & (short == (PASS == "short"))
    return expert, row0, pid_n, mine


@triton.jit
def persistent_items(live_tiles_ptr, num_n_tiles, claim_ptr):
    """(first item, end, live M tiles) of this program's work in a persistent launch: the grid is fixed (a
    few waves of the GPU, capturable) and its programs claim the live_tiles x num_n_tiles items, the tile
    count the layout left on the device, so the launch costs the live tiles' work, not the grid's.

    Items are claimed in order from a counter the launch shares (next_item), not strided statically:
    with a fixed stride the programs drift apart, the items in flight spread over the whole range and
    the M tiles of an expert group no longer meet their weight and A tiles in L2 (H200, EP 2 / 8192
    tokens without a bound: GEMM1 +30 %, benchmarks/results/h200_persistent_grid_ab.json). Claimed in
    order they stay one window, as the hardware hands out the programs of a plain grid.

    A launch with no live tile (a tile config the live pair count did not pick) claims nothing and
    leaves the counters alone (release_claims), so its programs exit without an atomic: every program
    of the launch reads the same count, so either all of them claim or none does. Masked atomics, not
    a branch: with an `if` around the first claim ptxas laid out the persistent prefill GEMM2's K loop
    6 instructions longer (benchmarks/research/sass_report.py) and the bounded EP 8 / 8192 step ran
    ~2 % slower on the H200; masked, the full passes' K loops are as long as without the skip."""
    m_tiles = tl.load(live_tiles_ptr)
    end = m_tiles * num_n_tiles
    first = tl.atomic_add(claim_ptr, 1, sem="relaxed", mask=end > 0)  # masked off: no atomic, no item
    return tl.where(end > 0, first, end), end, m_tiles


@triton.jit
def next_item(claim_ptr):
    """The next unclaimed item of this launch (one relaxed atomic per item, its result shared by the program)."""
    return tl.atomic_add(claim_ptr, 1, sem="relaxed")


@triton.jit
def release_claims(claim_ptr, end):
    """After a program's last claim: the last program of the launch zeroes the counters (the item
    counter and this arrival count) for the next persistent launch, which stream order starts after
    this one; acq_rel orders each program's claims before its arrival. A launch with nothing to
    claim (``end`` 0, persistent_items) touched neither counter and skips this."""
    arrived = tl.atomic_add(claim_ptr + 1, 1, sem="acq_rel", mask=end > 0)
    if (end > 0) & (arrived == tl.num_programs(0) - 1):
        tl.store(claim_ptr, 0)
        tl.store(claim_ptr + 1, 0)


@triton.jit
def tile_coords(pid, num_m_tiles, num_n_tiles, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M consecutive M tiles (usually one expert) share each weight tile in L2."""
    per_group = GROUP_M * num_n_tiles
    group = pid // per_group
    first_m = group * GROUP_M
    size = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    return pid_m, pid_n


@triton.jit
def _fragment_pieces(rb0, num_rb, chunks, KB: tl.constexpr, RB: tl.constexpr, PIECES: tl.constexpr, CHUNK: tl.constexpr):
    """Byte offsets [KB * RB * PIECES, 16] at k0 = 0 (+ the row mask) of a tile's 16-byte pieces of a
    fragment array with CHUNK bytes per (16-row block, K chunk) and ``chunks`` K chunks per row block:
    row r is piece r % PIECES of chunk (kb, rb) = (r // (RB * PIECES), rb0 + r // PIECES % RB)."""
    r = tl.arange(0, KB * RB * PIECES)
    rb = rb0 + (r // PIECES) % RB
    off = (rb.to(tl.int64) * chunks + r // (RB * PIECES)) * CHUNK + (r % PIECES) * 16
    return off[:, None] + tl.arange(0, 16)[None, :], (rb < num_rb)[:, None]


@triton.jit
def _e4m3_mma(w, a, acc, F32_DOT: tl.constexpr):
    """acc += [BN, BK] e4m3 bytes (uint8) x [BK, BM] e4m3 (float8e4nv; uint8 in the interpreter) on the
    FP8 tensor cores (the interpreter: exact integer decode, fp32 dot)."""
    if F32_DOT:
        return tl.dot(decode_e4m3(w), decode_e4m3(a), acc, input_precision="ieee")
    return tl.dot(w.to(tl.float8e4nv, bitcast=True), a, acc)


@triton.jit
def _retire(acc):
    """acc, once every wgmma writing it has finished: an opaque identity on the accumulator, so
    Triton waits for all of them (wgmma.wait_group 0) before it.

    Why: the W operand of the fragment decoders' wgmmas comes from registers (the decoded fragments).
    Triton 3.6 pipelines a K step's wgmma groups into the next step (up to three left in flight) and
    the sm_90a code then writes the next step's decoded weights into registers that a queued wgmma
    still reads (benchmarks/research/sass_report.py counts such writes: `loop_inflight_a_writes`). On the H200 the
    frag8 GEMM2 with the bf16 wire epilogue gave wrong output columns in ~1 in 6 prefill tiles at
    8192 tokens, different on every run; retired at the end of each K step, every run was bit for
    bit the encode of the fp32 rows (benchmarks/results/h200_fp8_rs_race.json)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _frag_weights(words, scale_bytes, DECODE: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One K step of fragment words [KB, RB, 32, 16] + the step's scale bytes as loaded (frag: read
    as [KB, RB, 8 (g), 4 (j, dr)]; frag8: [RB, 8 (g), 4 (c), 2 (dr)], BK = 128) -> the W tile [BN, BK]
    in the MMA's register layout (the reshapes only rename registers).

    frag (bf16 kind): bf16 values x 2**-63 (the caller undoes it); frag8 (fp8 kind): e4m3 bytes of
    W / row_scale, decoded by PRMT lookups in the tables built here from each block's S byte."""
    KB: tl.constexpr = BK // 64
    RB: tl.constexpr = BN // 16
    if DECODE == "frag":
        pair = tl.reshape(scale_bytes, [KB, RB, 8, 4]).to(tl.int32) * 0x00800080  # bf16x2 bits of 2**(s - 64), both halves
        pair = tl.broadcast_to(tl.reshape(pair, [KB, RB, 8, 1, 2, 1, 2, 1]), [KB, RB, 8, 4, 2, 2, 2, 2])
        x, y = decode_fp4_frag(words, tl.reshape(pair, [KB, RB, 32, 16]), USE_ASM)
        w = tl.reshape(tl.join(x, y), [KB, RB, 8, 4, 4, 2, 2, 2])  # kb rb g c step dr dk h
        w = tl.reshape(tl.permute(w, [1, 5, 2, 0, 4, 7, 3, 6]), [BN, BK])  # (rb dr g) x (kb step h c dk)
    else:
        # one PRMT table per row and K step (the fp8 kind's K order puts a lane's 128-step weights of a
        # row in one 32-block): e4m3 bytes of {0, .5, .., 6} x 2**(S - 5), from S [RB, g, c, dr]
        rep = tl.reshape(scale_bytes, [RB, 8, 4, 2]).to(tl.int32) * 8
        lut = tl.join(rep * 0x01010100 + _LUT_LO, rep * 0x01010101 + _LUT_HI)  # [RB, g, c, dr, lo/hi]
        lut = tl.broadcast_to(tl.reshape(lut, [1, RB, 8, 4, 1, 1, 4]), [KB, RB, 8, 4, 2, 2, 4])  # g c j b2 (dr lohi)
        x, y = decode_fp4_frag8(words, tl.reshape(lut, [KB, RB, 32, 16]), USE_ASM)
        w = tl.reshape(tl.join(x, y), [KB, RB, 8, 4, 2, 2, 4, 2])  # kb rb g c j b2 i dr
        w = tl.reshape(tl.permute(w, [1, 7, 2, 0, 4, 5, 3, 6]), [BN, BK])  # (rb dr g) x (kb j b2 c i)
    return w


@triton.jit
def frag_mainloop(
    acc, w_ptr, ws_ptr, wrs_ptr, rb0, num_rb, a_ptr, a_rows, a_mask, stride_am, ars_ptr, K,
    DECODE: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    F32_DOT: tl.constexpr, W_FULL: tl.constexpr = False,
):
    """acc[BN, BM] += W[BN, K] @ A[BM, K]^T with W in fragment order (fragments.py); see frag_mainloop_ride.
    W_FULL defaults to the masked loads for the standalone probes (scripts/gluon_*probe.py) that call this."""
    acc, _ = frag_mainloop_ride(
        acc, acc, w_ptr, ws_ptr, wrs_ptr, rb0, num_rb, a_ptr, a_rows, a_mask, a_rows, a_mask, stride_am, ars_ptr, K,
        DECODE, USE_ASM, BN, BM, BK, F32_DOT, 0, W_FULL,
    )
    return acc


@triton.jit
def frag_tile_mainloop(
    acc, w_ptr, ws_ptr, wrs_ptr, rb0, num_rb, a_ptr, row0, a_rows, valid, stride_am, ars_ptr, K, sorted_ptr,
    DECODE: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    F32_DOT: tl.constexpr, RIDE: tl.constexpr, A_ROWS_MAPPED: tl.constexpr, W_FULL: tl.constexpr,
):
    """A GEMM tile's K loop over fragment weights for the tile's rows (row0 + arange(BM); their A rows
    ``a_rows``), plus, with RIDE > 0, the rider: the next tile's first RIDE rows (claim_tile's "ride"
    pass). sorted_ptr: per sorted row a value that is -1 on padding rows (layout.sorted_row for
    GEMM1, sorted_pair for GEMM2); A_ROWS_MAPPED: that value is the row of A (GEMM1: the received
    row), else A is indexed by the sorted row itself (GEMM2's A2); W_FULL: frag_mainloop_ride.
    Returns (acc, acc_r, r_rows, r_map)
    — the rider's accumulator, sorted rows and sorted_ptr values; with RIDE == 0 those three are
    placeholders the caller must not use."""
    if RIDE > 0:
        r_rows = row0 + BM + tl.arange(0, RIDE)
        r_map = tl.load(sorted_ptr + r_rows)
        r_valid = r_map >= 0
        if A_ROWS_MAPPED:
            r_a_rows = tl.where(r_valid, r_map, 0)
        else:
            r_a_rows = r_rows
        acc, acc_r = frag_mainloop_ride(
            acc, tl.zeros((BN, RIDE), dtype=tl.float32), w_ptr, ws_ptr, wrs_ptr, rb0, num_rb, a_ptr, a_rows, valid,
            r_a_rows, r_valid, stride_am, ars_ptr, K, DECODE, USE_ASM, BN, BM, BK, F32_DOT, RIDE, W_FULL,
        )
        return acc, acc_r, r_rows, r_map
    else:
        acc = frag_mainloop(acc, w_ptr, ws_ptr, wrs_ptr, rb0, num_rb, a_ptr, a_rows, valid, stride_am, ars_ptr, K,
                            DECODE, USE_ASM, BN, BM, BK, F32_DOT, W_FULL)
        return acc, acc, a_rows, a_rows


@triton.jit
def frag_mainloop_ride(
    acc, acc_r, w_ptr, ws_ptr, wrs_ptr, rb0, num_rb, a_ptr, a_rows, a_mask, r_rows, r_mask, stride_am, ars_ptr, K,
    DECODE: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    F32_DOT: tl.constexpr, RIDE: tl.constexpr, W_FULL: tl.constexpr,
):
    """acc[BN, BM] += W[BN, K] @ A[BM, K]^T with W in fragment order (fragments.py), and with RIDE > 0
    also acc_r[BN, RIDE] += W @ A[r_rows]^T for a rider's rows (claim_tile's "ride" pass) from the
    same decoded W: one more MMA per K step instead of a second tile that decodes W again.
    Returns (acc, acc_r); acc_r is untouched when RIDE == 0.

    w_ptr / ws_ptr: this expert's words [N/16, K/64, 32, 16] / scale bytes (frag: [N/16, K/64, 8, 4],
    frag8: [N/16, K/128, 8, 4, 2] with K in the fp8 kind's order, so BK must be 128); rb0:
    first 16-row block of the tile, num_rb: N / 16. One 128-bit load per lane and 64-wide K chunk.
    a_rows / r_rows: rows of A (GEMM1: received rows, GEMM2: expert-sorted rows of A2).
    DECODE "frag": bf16 MMA, A bf16 in natural order. DECODE "frag8": FP8 MMA on W' = W / row_scale
    (block scales folded in by the decode) and A' = e4m3 rows over one power-of-two scale per row,
    K in the same fp8 order as W' (gather.rowscale_e4m3_kernel), typed float8e4nv so the loads land
    in the MMA's shared layout (uint8 under the interpreter); both row scales (wrs_ptr: this
    expert's [N], ars_ptr: per row of A', indexed like it) are applied after the loop. No partial
    sum is rescaled inside it, so the wgmmas chain in both modes.
    wrs_ptr / ars_ptr are not read by "frag".
    W_FULL: every weight row of the tile exists (N % BN == 0, true at DeepSeek shapes), so the W / S
    loads carry no row mask: 7-9 instructions fewer per K step (predicates and zero-fill selects),
    -2 % at 8192 tokens per rank on the H200 (docs/triton.md).
    """
    RB: tl.constexpr = BN // 16
    KB: tl.constexpr = BK // 64
    tl.static_assert(DECODE != "frag8" or BK == 128, "frag8 steps K by its weights' 128-wide K chunk")
    # The loads are 2-D [16-byte pieces, 16]: as 4-D tensors Triton's coalescing spread one warp's
    # lanes over 16 chunks 512 bytes apart (8-way shared-memory bank conflicts on every cp.async
    # write, 4x the L2 sectors for the scales); as rows, consecutive lanes take consecutive pieces.
    # Words: 32 pieces (lanes) per chunk; scales: 2 pieces per 64-wide chunk (frag: g 0-3, g 4-7) or
    # 4 per 128-wide step (frag8: g 0-1, .., g 6-7). The reshapes after the loads are register renames.
    w_off, wm = _fragment_pieces(rb0, num_rb, K // 64, KB, RB, 32, 512)
    if DECODE == "frag":
        s_off, sm = _fragment_pieces(rb0, num_rb, K // 64, KB, RB, 2, 32)
    else:  # BK == 128: one 64-byte chunk of S bytes per 16-row block and step
        s_off, sm = _fragment_pieces(rb0, num_rb, K // 128, 1, RB, 4, 64)
    ar = a_rows.to(tl.int64)[None, :]
    am = a_mask[None, :]
    rr = r_rows.to(tl.int64)[None, :]
    rm = r_mask[None, :]
    kk = tl.arange(0, BK)
    for k0 in range(0, K, BK):
        step = k0 // 64
        # S bytes per K are the same for both kinds: frag 32 per 64-wide chunk, frag8 64 per 128-wide step
        if W_FULL:
            words = tl.reshape(tl.load(w_ptr + w_off + step * 512), [KB, RB, 32, 16])
            s_bytes = tl.load(ws_ptr + s_off + step * 32)
        else:
            words = tl.reshape(tl.load(w_ptr + w_off + step * 512, mask=wm, other=0), [KB, RB, 32, 16])
            s_bytes = tl.load(ws_ptr + s_off + step * 32, mask=sm, other=0)
        w = _frag_weights(words, s_bytes, DECODE, USE_ASM, BN, BK)
        a = tl.load(a_ptr + ar * stride_am + (k0 + kk)[:, None], mask=am, other=0.0)
        if DECODE == "frag":
            acc = _mma(w, a, acc, F32_DOT)
        else:
            acc = _e4m3_mma(w, a, acc, F32_DOT)
        if RIDE > 0:
            r = tl.load(a_ptr + rr * stride_am + (k0 + kk)[:, None], mask=rm, other=0.0)
            if DECODE == "frag":
                acc_r = _mma(w, r, acc_r, F32_DOT)
            else:
                acc_r = _e4m3_mma(w, r, acc_r, F32_DOT)
        if not F32_DOT:  # every wgmma of the step done before the next step's decode reuses w's registers
            if RIDE > 0:
                acc_r = _retire(acc_r)  # the step's last group: waiting for it waits for all
            acc = _retire(acc)
    if DECODE == "frag":
        acc = acc * SPLIT_UNSCALE
        if RIDE > 0:
            acc_r = acc_r * SPLIT_UNSCALE
    else:
        w_rows = rb0 * 16 + tl.arange(0, BN)
        w_scale = tl.load(wrs_ptr + w_rows, mask=w_rows < num_rb * 16, other=0.0)
        a_scale = tl.load(ars_ptr + a_rows, mask=a_mask, other=0.0)
        acc = acc * w_scale[:, None] * a_scale[None, :]
        if RIDE > 0:
            r_scale = tl.load(ars_ptr + r_rows, mask=r_mask, other=0.0)
            acc_r = acc_r * w_scale[:, None] * r_scale[None, :]
    return acc, acc_r
