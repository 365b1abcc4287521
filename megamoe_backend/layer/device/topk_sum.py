"""The top-k sum: each token's k combine wire rows, dequantised and summed in fp32, in k order.

Why one kernel: in torch this was an fp32 [T, k, H] zeros tensor, a scatter and a sum (at 8192
tokens x top-6 x hidden 7168, 1.4 GB written and read: 4-6 ms on an H200). Here each program reads
its token's k rows once (bf16, or fp8 e4m3 + one E8M0 scale per 1x32 block), adds them into an fp32
accumulator in fixed k order starting from +0.0, multiplies by ``output_scale`` and rounds once to
bf16. A pair that did not run (slot -1) is a masked load of 0.0, exactly what the torch sum added
for it, so the result equals ``sum(dim=1)`` of the zero-filled [T, k, H] tensor bit for bit.

Rows whose sum is not finite are recorded in the status word (status.py): the host raises at the
next check, naming the row; the row itself is written as computed (it touches no other row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...experts.triton.mxjit import decode_e4m3, decode_e8m0, round_bf16
from .status import NONFINITE_ROW

BLOCK_H = 1024


@triton.jit
def _topk_sum_kernel(
    rows_ptr, row_stride, pair_slot_ptr, out_ptr, out_stride, status_ptr, layer_id, output_scale, H,
    K: tl.constexpr, FMT: tl.constexpr, BLOCK_H: tl.constexpr, BAD_CODE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        p = t * K + j
        ran = tl.load(pair_slot_ptr + p) >= 0
        base = rows_ptr + p * row_stride
        m = in_row & ran
        if FMT == "bf16":  # rows viewed as int16: a bf16 is the top half of its fp32
            v = (tl.load(base + cols, mask=m, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            v = decode_e4m3(tl.load(base + cols, mask=m, other=0))
            s = tl.load(base + H + cols // 32, mask=m, other=127)
            v = v * decode_e8m0(s)
        acc += v
    acc = acc * output_scale
    bad = in_row & ((acc != acc) | (tl.abs(acc) == float("inf")))
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    if n_bad > 0:
        zero = n_bad.to(tl.int64) * 0  # int64 operands: the CAS must match the word's type
        if tl.atomic_cas(status_ptr, zero, zero + BAD_CODE) == 0:
            tl.store(status_ptr + 1, zero + layer_id)  # (an int arg may arrive as a constant)
            tl.store(status_ptr + 3, t)
    tl.store(out_ptr + t * out_stride + cols, round_bf16(acc).to(tl.bfloat16), mask=in_row)


def topk_sum(
    rows: torch.Tensor, pair_slot: torch.Tensor, out: torch.Tensor, wire_mx: str | None, hidden: int, topk: int,
    status_word: torch.Tensor, layer_id: int, output_scale: float = 1.0,
) -> torch.Tensor:
    """rows uint8 [T*k, row_bytes] (pair t*k+j = token t's j-th entry), pair_slot int64 [T*k] -> out bf16 [T, H]."""
    t = out.shape[0]
    if t == 0:
        return out
    if wire_mx not in (None, "fp8"):
        raise ValueError(f"the top-k sum reads bf16 or fp8_blockwise_1x32 combine rows, not {wire_mx!r}")
    if wire_mx is None:
        rows = rows.view(torch.int16)  # [P, H]: the kernel widens each bf16 to fp32 by a shift
    _topk_sum_kernel[(t, triton.cdiv(hidden, BLOCK_H))](
        rows, rows.stride(0), pair_slot, out, out.stride(0), status_word, layer_id, float(output_scale), hidden,
        K=topk, FMT="bf16" if wire_mx is None else "fp8", BLOCK_H=BLOCK_H, BAD_CODE=NONFINITE_ROW,
    )
    return out


def topk_sum_torch(values: torch.Tensor, pair_slot: torch.Tensor, topk: int, output_scale: float = 1.0) -> torch.Tensor:
    """Reference: fp32 pair values [T*k, H] -> bf16 [T, H], the zero-filled torch sum the layer used."""
    h = values.shape[1]
    v = torch.where((pair_slot >= 0).unsqueeze(1), values, torch.zeros((), dtype=values.dtype, device=values.device))
    summed = v.view(-1, topk, h).sum(dim=1)
    if output_scale != 1.0:
        summed = summed * output_scale
    return summed.to(torch.bfloat16)
