"""The K loop shared by GEMM1 and GEMM2: acc[BN, BM] += W[BN, K] @ A[BM, K]^T, one expert.

Swap-AB orientation: the weight rows fill the MMA's M side (>= 64 rows per tile) and the few tokens
an expert gets at decode fill its N side (>= 16), so small token tiles waste no tensor-core rows;
the weight operand is the one that is decoded in registers.

Three decoders, chosen by the constexpr DECODE:
- "split" (fastest on H200): A arrives pre-dequantised to bf16 with every BK block stored as
  [even K elements | odd K elements] (gather.py / GEMM1's epilogue write it so), W's packed bytes are
  decoded by an 8-values-per-call PTX sequence (mxjit.decode_fp4_split, USE_ASM) into a low-nibble
  and a high-nibble tile, and two bf16 MMAs consume them: no register shuffles, every load contiguous
  and software-pipelined. With USE_ASM=False the same decode runs through portable helpers
  (interpreter).
- "dot_scaled": ``tl.dot_scaled`` (Triton's own upcast on Hopper; native MX MMA on Blackwell).
- "manual": explicit decode of W and of MX A in Triton, two MMAs over even / odd K (stride-2 loads).
All are exact: e2m1 / e4m3 values times a power-of-two scale are representable in bf16.
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
    e4m3_scale,
    scale_bf16_shifted,
)


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
def assume_k_loop_runs(K, BK: tl.constexpr):
    """Tell the compiler the K loop runs at least once (true: BK is shrunk to divide K, K >= 32).
    Without it LLVM may keep a zero-trip path that writes the accumulators, and ptxas then
    serialises every wgmma of the loop (info C7515): frag GEMM1 did so at commit ce681ac, split
    GEMM1 / GEMM2 up to 8873e5a. Called by both GEMM kernels before any mainloop; tests/triton/test_sass.py
    checks the compiled loops."""
    tl.assume(K >= BK)


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
def _fragment_pieces(rb0, num_rb, K, KB: tl.constexpr, RB: tl.constexpr, PIECES: tl.constexpr, CHUNK: tl.constexpr):
    """Byte offsets [KB * RB * PIECES, 16] at k0 = 0 (+ the row mask) of a tile's 16-byte pieces of a
    fragment array with CHUNK bytes per (16-row block, 64-wide K chunk): row r is piece r % PIECES of
    chunk (kb, rb) = (r // (RB * PIECES), rb0 + r // PIECES % RB)."""
    r = tl.arange(0, KB * RB * PIECES)
    rb = rb0 + (r // PIECES) % RB
    off = (rb.to(tl.int64) * (K // 64) + r // (RB * PIECES)) * CHUNK + (r % PIECES) * 16
    return off[:, None] + tl.arange(0, 16)[None, :], (rb < num_rb)[:, None]


@triton.jit
def frag_mainloop(
    acc, w_ptr, ws_ptr, rb0, num_rb, a_ptr, a_rows, a_mask, stride_am, K,
    USE_ASM: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr,
):
    """acc[BN, BM] += W[BN, K] @ A[BM, K]^T with W in fragment order (fragments.py), A bf16 natural order.

    w_ptr / ws_ptr: this expert's words [N/16, K/64, 32, 16] / scales [N/16, K/64, 8, 4]; rb0: first
    16-row block of the tile, num_rb: N / 16. One 128-bit load per lane and 64-wide K chunk; the
    decode yields the wgmma A registers directly, the reshapes below only rename them.
    """
    RB: tl.constexpr = BN // 16
    KB: tl.constexpr = BK // 64
    # The loads are 2-D [16-byte pieces, 16]: as 4-D tensors Triton's coalescing spread one warp's
    # lanes over 16 chunks 512 bytes apart (8-way shared-memory bank conflicts on every cp.async
    # write, 4x the L2 sectors for the scales); as rows, consecutive lanes take consecutive pieces.
    # Words: 32 pieces (lanes) per chunk; scales: 2 pieces (g 0-3, g 4-7). The reshapes after the
    # loads are register renames.
    w_off, wm = _fragment_pieces(rb0, num_rb, K, KB, RB, 32, 512)
    s_off, sm = _fragment_pieces(rb0, num_rb, K, KB, RB, 2, 32)
    ar = a_rows.to(tl.int64)[None, :]
    am = a_mask[None, :]
    kk = tl.arange(0, BK)
    for k0 in range(0, K, BK):
        step = k0 // 64
        words = tl.reshape(tl.load(w_ptr + w_off + step * 512, mask=wm, other=0), [KB, RB, 32, 16])
        s8 = tl.reshape(tl.load(ws_ptr + s_off + step * 32, mask=sm, other=0), [KB, RB, 8, 4])  # g, (j, dr)
        pair = s8.to(tl.int32) * 0x00800080  # bf16x2 bits of 2**(s - 64), both halves
        pair = tl.broadcast_to(tl.reshape(pair, [KB, RB, 8, 1, 2, 1, 2, 1]), [KB, RB, 8, 4, 2, 2, 2, 2])
        pair = tl.reshape(pair, [KB, RB, 32, 16])
        x, y = decode_fp4_frag(words, pair, USE_ASM)
        w = tl.reshape(tl.join(x, y), [KB, RB, 8, 4, 4, 2, 2, 2])  # kb rb g c step dr dk h
        w = tl.reshape(tl.permute(w, [1, 5, 2, 0, 4, 7, 3, 6]), [BN, BK])  # (rb dr g) x (kb step h c dk)
        a = tl.load(a_ptr + ar * stride_am + (k0 + kk)[:, None], mask=am, other=0.0)
        acc = _mma(w, a, acc, F32_DOT)
    return acc * SPLIT_UNSCALE


@triton.jit
def _e4m3_dot(w, a, F32_DOT: tl.constexpr):
    """[BN, 32] e4m3 bytes (uint8) x [32, BM] e4m3 (float8e4nv; uint8 in the interpreter) -> fp32, one
    FP8 wgmma from a zero accumulator."""
    if F32_DOT:  # the interpreter: exact integer decode, fp32 dot
        return tl.dot(decode_e4m3(w), decode_e4m3(a), input_precision="ieee")
    return tl.dot(w.to(tl.float8e4nv, bitcast=True), a)


@triton.jit
def frag8_mainloop(
    acc, w_ptr, ws_ptr, stride_wsn, rb0, num_rb, a_ptr, a_rows, a_mask, stride_am, as_ptr, stride_asm, K,
    USE_ASM: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr,
):
    """acc[BN, BM] += W[BN, K] @ A[BM, K]^T on the FP8 tensor cores, both operands e4m3 with 1x32 scales.

    w_ptr: this expert's fp8-kind fragment words [N/16, K/64, 32, 16]; ws_ptr: its row-major E8M0
    scales [N, K/32]; A: expert-sorted e4m3 bytes [rows, K] with E8M0 scales [rows, K/32] (for an
    MXFP4 A the bytes are value * 2**-6 and the scale byte is s + 6, see gather.py), typed float8e4nv
    so the loads land in the MMA's shared layout directly (uint8 under the interpreter). Each 32-wide K
    step is one wgmma from zero, rescaled into the fp32 accumulator by its two block scales.
    """
    RB: tl.constexpr = BN // 16
    NS: tl.constexpr = BK // 32  # 32-wide K steps per iteration
    tl.static_assert(NS == 2 or NS == 4, "frag8 takes block_k 64 or 128")
    rb = rb0 + tl.arange(0, RB)
    lane = tl.arange(0, 32)
    # one 32-wide K step of a 16 x 64 block = 8 bytes per lane (words b3 * 2 + {0, 1}); loading each
    # step separately keeps bytes 0..3 of a word in consecutive registers (the PTX takes 4 at a time)
    w_off = rb.to(tl.int64)[:, None, None] * (K // 64) * 512 + (lane * 16)[None, :, None] + tl.arange(0, 8)[None, None, :]
    wm = (rb < num_rb)[:, None, None]
    w_rows = rb0 * 16 + tl.arange(0, BN)
    wmask = (w_rows < num_rb * 16)[:, None]
    ar = a_rows.to(tl.int64)[None, :]
    am = a_mask[None, :]
    kk = tl.arange(0, 32)
    ks = tl.arange(0, NS)
    for k0 in range(0, K, BK):
        # block scales of the whole step, [BN | BM, NS], one column per 32-wide K step
        sw = e4m3_scale(tl.load(ws_ptr + w_rows.to(tl.int64)[:, None] * stride_wsn + (k0 // 32 + ks)[None, :], mask=wmask, other=0), 6, False)
        sa = e4m3_scale(tl.load(as_ptr + a_rows.to(tl.int64)[:, None] * stride_asm + (k0 // 32 + ks)[None, :],
                                mask=a_mask[:, None], other=0), 0, True)
        if NS == 2:
            sw0, sw1 = tl.split(sw)
            sa0, sa1 = tl.split(sa)
            sws = (sw0, sw1)
            sas = (sa0, sa1)
        else:  # column 2 * a + b: split b, then a (register-only)
            swl, swh = tl.split(tl.reshape(sw, [BN, 2, 2]))
            sal, sah = tl.split(tl.reshape(sa, [BM, 2, 2]))
            sw0, sw2 = tl.split(swl)
            sw1, sw3 = tl.split(swh)
            sa0, sa2 = tl.split(sal)
            sa1, sa3 = tl.split(sah)
            sws = (sw0, sw1, sw2, sw3)
            sas = (sa0, sa1, sa2, sa3)
        for j in tl.static_range(NS):
            k = k0 + 32 * j
            words = tl.load(w_ptr + w_off + (k // 64) * 512 + (j % 2) * 8, mask=wm, other=0)  # [RB, 32, 8]
            x, y = decode_fp4_frag8(words, USE_ASM)  # rows g / g + 8
            w = tl.reshape(tl.join(x, y), [RB, 8, 4, 2, 4, 2])  # rb g c b2 i h
            w = tl.reshape(tl.permute(w, [0, 5, 1, 3, 2, 4]), [BN, 32])  # (rb h g) x (b2 c i)
            a = tl.load(a_ptr + ar * stride_am + (k + kk)[:, None], mask=am, other=0.0)
            acc = acc + _e4m3_dot(w, a, F32_DOT) * (sws[j][:, None] * sas[j][None, :])
    return acc
