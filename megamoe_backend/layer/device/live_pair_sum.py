"""Each received row's sum over its local pairs, for the live rows only: what the mori device forward
hands mori's combine (which then sums the ranks' partial rows in-kernel).

Why a kernel with a device count: mori's dispatch fills the first ``total_recv`` rows of a buffer
of ep x MEGA_MAX_TOKENS_PER_RANK rows, and ``total_recv`` is on the device. The top-k sum of the
CUDA device forwards (topk_sum.py) runs one program per row of a host-sized grid; at EP 8 / 8192
that is 65536 rows per layer at every decode step. Here a fixed (capturable) grid of programs
strides over the rows below the count it reads, so a step costs its live rows. Pair q = row * k + j
(mori's received top-k order); a pair with slot -1 (not this rank's, a repeat, or a dead row) is a
masked load of 0.0. bf16 pair rows in, fp32 sums in k order from +0.0, one bf16 rounding: the same
bits as ``topk_sum`` with the bf16 wire for the live rows. Rows at or past the count are not written
(mori's combine reads only the rows it delivered).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...experts.triton.mxjit import round_bf16
from ...experts.triton.launch_plan import persistent_grid

BLOCK_H = 1024


@triton.jit
def _live_pair_sum_kernel(rows_ptr, row_stride, slot_ptr, out_ptr, out_stride, count_ptr, H,
                          K: tl.constexpr, BLOCK_H: tl.constexpr):
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < H
    n = tl.load(count_ptr).to(tl.int32)
    for t in range(tl.program_id(0), n, tl.num_programs(0)):
        row = tl.cast(t, tl.int64)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            p = row * K + j
            ran = tl.load(slot_ptr + p) >= 0
            v = tl.load(rows_ptr + p * row_stride + cols, mask=in_row & ran, other=0)
            acc += (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)  # bf16 = the top half of its fp32
        tl.store(out_ptr + row * out_stride + cols, round_bf16(acc).to(tl.bfloat16), mask=in_row)


def live_pair_sum(rows: torch.Tensor, pair_slot: torch.Tensor, count: torch.Tensor, out: torch.Tensor, topk: int) -> torch.Tensor:
    """rows uint8 [R*k, 2H] (bf16 pair rows), pair_slot int64 [R*k], count int64 [1] -> out bf16 [R, H] (live rows)."""
    r, hidden = out.shape
    if r == 0:
        return out
    rows16 = rows.view(torch.int16)
    grid = (min(r, persistent_grid(out.device)), triton.cdiv(hidden, BLOCK_H))
    _live_pair_sum_kernel[grid](rows16, rows16.stride(0), pair_slot, out, out.stride(0), count, hidden, K=topk,
                                BLOCK_H=BLOCK_H)
    return out


def live_pair_sum_torch(values: torch.Tensor, pair_slot: torch.Tensor, count: int, topk: int) -> torch.Tensor:
    """Reference: fp32 pair values [R*k, H] -> bf16 [count, H] (tests)."""
    v = torch.where((pair_slot >= 0).unsqueeze(1), values, torch.zeros((), dtype=values.dtype))
    return v.view(-1, topk, values.shape[1])[:count].sum(dim=1).to(torch.bfloat16)
