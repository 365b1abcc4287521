"""Triton row quantisation: bf16/fp32 rows -> MXFP8 / MXFP4 with one E8M0 scale per 1x32 block, or the
block-FP8 A format ``fp8_g128`` (e4m3 with one fp32 scale per 1x128 group, quantize_g128).

Bit-identical to ``megamoe_backend.formats.quantize_mx``: same scale rule and rounding, scales
everywhere (a block holding NaN/Inf gets 0xFF) and payload bytes of every finite block. Payload
bytes inside a NaN-scale block dequantise to NaN whatever they are; they follow CUDA's NaN and
saturation conventions, which torch on x86 does not share bit for bit. ``encode_wire_rows`` quantises once and writes the dispatch wire row directly
(payload, then scales, in one uint8 buffer), so the sender never materialises a second copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...formats import MX_BLOCK, GroupFP8Tensor, MXTensor
from ...formats.block_fp8 import A_FORMAT as FP8_G128
from ...formats.block_fp8 import FP8_BLOCK
from .config import interpreting
from .layout_kernels import live_pairs_total, live_rows_args, live_to_index
from .mxjit import (
    FP4_MANT_LIMIT,
    FP4_MAX_EXP,
    FP8_MANT_LIMIT,
    FP8_MAX_EXP,
    block_amax,
    encode_e2m1,
    encode_e4m3,
    pow2,
    scale_exponent,
)

BLOCKS_PER_PROGRAM = 8  # 8 x 32 elements per program: one 16-byte store per thread for fp8


@triton.jit
def quantize_blocks(x, FMT: tl.constexpr, HW_CVT: tl.constexpr = False):
    """x [B, 32] fp32 -> (payload [B, 32] uint8 (fp8) or [B, 16] uint8 (fp4), scales [B] uint8).

    HW_CVT (GPU only, fp8): the e4m3 bytes by the GPU's own conversion (cvt.rn.satfinite: RNE, the
    same bytes for every finite block, as the scaled values never exceed 448) instead of the integer
    rounding the interpreter needs: ~1 instruction per 2 values instead of ~30 per value, which
    matters in the GEMM epilogues."""
    amax, bad = block_amax(x)
    if FMT == "fp8":
        e = scale_exponent(amax, FP8_MANT_LIMIT, FP8_MAX_EXP)
    else:
        e = scale_exponent(amax, FP4_MANT_LIMIT, FP4_MAX_EXP)
    scaled = x * pow2(-e)[:, None]
    scales = tl.where(bad, 255, e + 127).to(tl.uint8)
    if FMT == "fp8" and HW_CVT:
        payload = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    elif FMT == "fp8":
        payload = encode_e4m3(scaled)
    else:
        codes = encode_e2m1(scaled)
        lo, hi = tl.split(tl.reshape(codes, [codes.shape[0], codes.shape[1] // 2, 2]))
        payload = (lo | (hi << 4)).to(tl.uint8)
    return payload, scales


@triton.jit
def quantize_g128(x, HW_CVT: tl.constexpr = False):
    """x [B, 128] fp32 -> (e4m3 bytes [B, 128] uint8, fp32 scales [B]): formats.block_fp8.quantize_groups bit for
    bit on finite groups. scale = max(amax, 1e-10) / 448 and q = clamp(x / scale, +-448) -> e4m3 RNE, both
    divisions IEEE (tl.div_rn: Triton's ``/`` on fp32 is an approximate division on NVIDIA GPUs, torch's is
    not). A group holding NaN / Inf gets a NaN scale (its bytes are don't-care). HW_CVT as quantize_blocks."""
    amax, bad = block_amax(x)
    scale = tl.div_rn(tl.maximum(amax, 1e-10), tl.full(amax.shape, 448.0, tl.float32))
    q = tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if HW_CVT:
        payload = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        payload = encode_e4m3(q)
    return payload, tl.where(bad, float("nan"), scale)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, stride_x, data_ptr, stride_data, scale_ptr, stride_scale, K, status_ptr, status_code, layer_id,
    FMT: tl.constexpr, BLOCKS: tl.constexpr, HW_CVT: tl.constexpr, STATUS: tl.constexpr,
    live_ptr=None, n_seg=1, seg_rows=0, PERSIST: tl.constexpr = False, N_SEG: tl.constexpr = 1,
    ids_ptr=None, ids_stride=0, TOPK: tl.constexpr = 0, TOPK_PAD: tl.constexpr = 1,
):
    """One program per (row, piece of BLOCKS x 32 columns); PERSIST (the live rows of a fixed region,
    experts/live.py LiveRows): a fixed grid strides over the (live row, piece) pairs only. TOPK > 0:
    a row whose route ids are all -1 (routes nowhere: a padded row) is neither quantised nor checked."""
    if not PERSIST:
        row = tl.program_id(0).to(tl.int64)
        routed = True
        if TOPK > 0:
            j = tl.arange(0, TOPK_PAD)
            routed = tl.max(tl.load(ids_ptr + row * ids_stride + j, mask=j < TOPK, other=-1).to(tl.int64), axis=0) >= 0
        if routed:
            _quantize_piece(row, tl.program_id(1), x_ptr, stride_x, data_ptr, stride_data,
                            scale_ptr, stride_scale, K, status_ptr, status_code, layer_id, FMT, BLOCKS, HW_CVT, STATUS)
    else:
        pieces = tl.cdiv(K // (128 if FMT == "fp8_g128" else 32), BLOCKS)
        c, total = live_pairs_total(live_ptr, n_seg, seg_rows, 1, N_SEG)
        for u in range(tl.program_id(0), total * pieces, tl.num_programs(0)):
            row = tl.sum(live_to_index(u // pieces + tl.zeros([1], tl.int32), c, seg_rows, N_SEG), 0)
            _quantize_piece(row, u % pieces, x_ptr, stride_x, data_ptr, stride_data, scale_ptr, stride_scale, K,
                            status_ptr, status_code, layer_id, FMT, BLOCKS, HW_CVT, STATUS)


@triton.jit
def _quantize_piece(row, piece, x_ptr, stride_x, data_ptr, stride_data, scale_ptr, stride_scale, K, status_ptr,
                    status_code, layer_id, FMT: tl.constexpr, BLOCKS: tl.constexpr, HW_CVT: tl.constexpr,
                    STATUS: tl.constexpr):
    GROUP: tl.constexpr = 128 if FMT == "fp8_g128" else 32  # elements per scale
    blk = piece * BLOCKS + tl.arange(0, BLOCKS)
    col = tl.arange(0, GROUP)
    nblk = K // GROUP
    bmask = blk < nblk
    x = tl.load(x_ptr + row * stride_x + blk[:, None] * GROUP + col[None, :], mask=bmask[:, None], other=0.0)
    if FMT == "fp8_g128":
        payload, scales = quantize_g128(x.to(tl.float32), HW_CVT)
        bad = scales != scales
    else:
        payload, scales = quantize_blocks(x.to(tl.float32), FMT, HW_CVT)
        bad = scales == 255
    if STATUS:  # report a row holding NaN / Inf (its blocks get the NaN scale: 0xFF, or an fp32 NaN) in the status word
        n_bad = tl.sum((bad & bmask).to(tl.int32), axis=0)
        if n_bad > 0:
            zero = n_bad.to(tl.int64) * 0
            if tl.atomic_cas(status_ptr, zero, zero + status_code) == 0:
                tl.store(status_ptr + 1, zero + layer_id)
                tl.store(status_ptr + 3, row)
    if FMT == "fp8" or FMT == "fp8_g128":
        tl.store(data_ptr + row * stride_data + blk[:, None] * GROUP + col[None, :], payload, mask=bmask[:, None])
    else:
        half = tl.arange(0, 16)
        tl.store(data_ptr + row * stride_data + blk[:, None] * 16 + half[None, :], payload, mask=bmask[:, None])
    tl.store(scale_ptr + row * stride_scale + blk, scales, mask=bmask)


def _check_rows(x: torch.Tensor, fmt: str, name: str) -> None:
    if fmt not in ("fp8", "fp4", FP8_G128):
        raise ValueError(f"{name}: unknown A format {fmt!r}; expected 'fp8', 'fp4' (MX) or {FP8_G128!r} (block-FP8)")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [rows, K] tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: expected bf16/fp16/fp32 rows, got {x.dtype}")
    group = FP8_BLOCK if fmt == FP8_G128 else MX_BLOCK
    if x.shape[1] % group:
        what = "the fp8_g128 group" if fmt == FP8_G128 else "the MX block"
        raise ValueError(f"{name}: K={x.shape[1]} is not a multiple of {what} ({group})")
    if x.stride(1) != 1:
        raise ValueError(f"{name}: rows must be contiguous along K (stride(1) == 1), got strides {x.stride()}")


def _launch(x: torch.Tensor, fmt: str, data: torch.Tensor, scales: torch.Tensor, status: tuple | None = None,
            live=None, programs: int | None = None, routed_ids: torch.Tensor | None = None) -> None:
    """``status``: (int64 status word, code, layer id) to record the first row holding NaN / Inf
    (layer/device/status.py); None: no report (the NaN scale alone marks such blocks). ``live``
    (LiveRows over the rows of ``x``): only those rows, by a fixed grid of ``programs``.
    ``routed_ids`` ([N, k] route ids): rows whose ids are all -1 are skipped, as the P2P dispatch
    skips them: the padded rows of an engine's captured batch hold whatever attention left there
    (NaN included), reach no expert, and must not be reported as bad input."""
    n, k = x.shape
    if n == 0:
        return
    word, code, layer = status if status is not None else (scales, 0, 0)
    pieces = triton.cdiv(k // (FP8_BLOCK if fmt == FP8_G128 else MX_BLOCK), BLOCKS_PER_PROGRAM)
    walk = {} if live is None else live_rows_args(live)
    if routed_ids is not None:
        if live is not None or routed_ids.dim() != 2 or routed_ids.shape[0] < n or routed_ids.stride(1) != 1:
            raise ValueError(f"routed_ids must be [>= {n}, k] with stride(1) == 1 (and no live rows), got "
                             f"{tuple(routed_ids.shape)}")
        topk = routed_ids.shape[1]
        walk = dict(ids_ptr=routed_ids, ids_stride=routed_ids.stride(0), TOPK=topk, TOPK_PAD=triton.next_power_of_2(topk))
    grid = (n, pieces) if live is None else (max(1, min(n * pieces, programs or n * pieces)),)
    _quantize_rows_kernel[grid](
        x, x.stride(0), data, data.stride(0), scales, scales.stride(0), k, word, code, layer,
        FMT=fmt, BLOCKS=BLOCKS_PER_PROGRAM, HW_CVT=x.is_cuda and not interpreting(), STATUS=status is not None, **walk,
    )


def quantize_rows(x: torch.Tensor, fmt: str, name: str = "x", out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  live=None, programs: int | None = None) -> MXTensor | GroupFP8Tensor:
    """[N, K] -> MXTensor(data [N, K] or [N, K // 2], scales [N, K // 32]); equals formats.quantize_mx. For
    ``fmt`` "fp8_g128": GroupFP8Tensor(data [N, K] uint8, scales fp32 [N, K // 128]), formats.quantize_groups.

    ``out``: the (data, scales) buffers to write (e.g. experts/scratch.py's), else fresh ones.
    ``live`` (experts/live.py LiveRows over the N rows): quantise the live rows only, by a fixed
    grid of ``programs`` (a region sized by capacity costs its live rows); the others stay as they were."""
    _check_rows(x, fmt, name)
    n, k = x.shape
    if out is None and fmt == FP8_G128:
        out = (torch.empty(n, k, dtype=torch.uint8, device=x.device),
               torch.empty(n, k // FP8_BLOCK, dtype=torch.float32, device=x.device))
    elif out is None:
        out = (torch.empty(n, k if fmt == "fp8" else k // 2, dtype=torch.uint8, device=x.device),
               torch.empty(n, k // MX_BLOCK, dtype=torch.uint8, device=x.device))
    data, scales = out
    _launch(x, fmt, data, scales, live=live, programs=programs)
    if fmt == FP8_G128:
        return GroupFP8Tensor(data=data, scales=scales)
    return MXTensor(data=data, scales=scales, fmt=fmt)


def encode_wire_rows(x: torch.Tensor, fmt: str, out: torch.Tensor | None = None, status: tuple | None = None,
                     routed_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] -> wire rows [N, payload + K // 32] uint8 (payload then scales), quantised once; for ``fmt``
    "fp8_g128" [N, K + 4 * K // 128] (e4m3, then the fp32 scales' bytes: formats.wire.encode_group_rows).

    ``out`` may be a preallocated (e.g. symmetric-memory) buffer with at least that many columns;
    only the first row_bytes of each row are written. ``status`` and ``routed_ids`` as for ``_launch``
    (a row that routes nowhere is left as it was in ``out``).
    """
    _check_rows(x, fmt, "wire rows")
    n, k = x.shape
    payload = k if fmt in ("fp8", FP8_G128) else k // 2
    row_bytes = payload + (4 * (k // FP8_BLOCK) if fmt == FP8_G128 else k // MX_BLOCK)
    if out is None:
        out = torch.empty(n, row_bytes, dtype=torch.uint8, device=x.device)
    elif out.dtype != torch.uint8 or out.dim() != 2 or out.shape[0] < n or out.shape[1] < row_bytes or out.stride(1) != 1:
        raise ValueError(f"wire out buffer must be uint8 [>= {n}, >= {row_bytes}] with stride(1) == 1, got {tuple(out.shape)} {out.dtype}")
    scales = out[:, payload:row_bytes]
    if fmt == FP8_G128:  # the fp32 scales of a row start 4-byte aligned when its stride is (row_bytes is a multiple of 4)
        if out.stride(0) % 4 or out.storage_offset() % 4:
            raise ValueError(f"{fmt} wire rows need a row stride and offset that are multiples of 4 bytes (fp32 scales), "
                             f"got stride {out.stride(0)}, offset {out.storage_offset()}")
        scales = scales.view(torch.float32)
    _launch(x, fmt, out[:, :payload], scales, status, routed_ids=routed_ids)
    return out
