"""The humming provider's numerics in torch, step by step (experts/humming/provider.py): the reference its
interpreter and GPU tests compare with row by row, tighter than the fp32 reference can (a wrong step of the
provider moves its rows far past TWIN_TOL; the MXFP4 / FP8 rounding the fp32 reference sees does not).

    A: MX fp8 rows -> e4m3 over 2**(s_max - 127) per row       (gather.rowscale_e4m3_kernel, natural K order)
    h = bf16(rs_a * A8 . W1_e)                                (humming GEMM1, bf16 out)
    act = silu(min(g, L)) * clamp(u, -L, L)                   (g, u: h's even / odd columns)
    A2 = MX fp8 per 32 of act, re-expressed as A             (swiglu_a2_kernel)
    y = bf16(rs_a2 * w * A2 . W2_e)                           (humming GEMM2, the route weight in its row scale)
"""

from __future__ import annotations

import torch

from megamoe_backend.experts import ExpertMath, ExpertPairs, ExpertWeights
from megamoe_backend.formats import MXTensor, dequantize_mx, quantize_mx

TWIN_TOL = 2e-2  # relL2 per pair row: fp64 vs the GPU's fp32 accumulation order, and an e4m3 tie now and then


def rowscaled(t: MXTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MX fp8 rows -> (e4m3 values over the row scale, fp32 [R]; the row scale 2**(s_max - 127), fp32 [R])."""
    s = t.scales.to(torch.int32)
    smax = s.amax(dim=-1, keepdim=True)
    q = dequantize_mx(MXTensor(t.data, torch.full_like(t.scales, 127), "fp8"))  # the e4m3 payload values
    shift = torch.pow(2.0, (s - smax).double()).float().repeat_interleave(32, dim=-1)
    e4 = (q * shift).to(torch.float8_e4m3fn).float()
    return e4, torch.pow(2.0, (smax[:, 0] - 127).double()).float()


def twin_forward(rows: MXTensor, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath) -> torch.Tensor:
    """fp32 [P, H] rows the humming provider computes for ``rows`` (row-major weights, any layout)."""
    w1, w2 = (w.double() for w in weights.dequantized())
    if weights.gate_up_layout == "plain":
        from megamoe_backend.experts import interleave_gate_up

        w1 = interleave_gate_up(w1)
    a8, rs = rowscaled(rows)
    out = torch.zeros(len(pairs), weights.hidden)
    limit = math.swiglu_limit
    for q in range(len(pairs)):
        r, e = int(pairs.row[q]), int(pairs.slot[q])
        h = ((a8[r].double() @ w1[e].T) * rs[r]).float().to(torch.bfloat16).float()
        g, u = h[0::2], h[1::2]
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        act = torch.nn.functional.silu(g) * u
        a2, rs2 = rowscaled(quantize_mx(act[None], "fp8"))
        y = (a2[0].double() @ w2[e].T) * float(rs2[0] * pairs.weight[q])
        out[q] = y.float().to(torch.bfloat16).float()
    return out


def twin_block_forward(rows, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath) -> torch.Tensor:
    """fp32 [P, H] rows the humming provider computes for block-FP8 experts on fp8_g128 ``rows`` (GroupFP8Tensor):

        h = bf16(sum over groups of s_a[g] * A_g . W1_e,g)     (humming GEMM1: 128 x 128 block-scaled, bf16 out)
        act = silu(min(g, L)) * clamp(u, -L, L)                (g, u: h's first / second half: plain rows)
        A2 = quantize_groups(act), each group scale x w        (swiglu_g128_kernel)
        y = bf16(sum over groups of s_a2[g] * A2_g . W2_e,g)   (humming GEMM2)"""
    from megamoe_backend.formats.block_fp8 import dequantize_groups, quantize_groups

    w1, w2 = (w.double() for w in weights.dequantized())
    a = dequantize_groups(rows).double()
    inter = weights.intermediate
    out = torch.zeros(len(pairs), weights.hidden)
    limit = math.swiglu_limit
    for q in range(len(pairs)):
        r, e = int(pairs.row[q]), int(pairs.slot[q])
        h = (a[r] @ w1[e].T).float().to(torch.bfloat16).float()
        g, u = h[:inter], h[inter:]
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        act = torch.nn.functional.silu(g) * u
        a2 = quantize_groups(act[None])
        a2 = type(a2)(a2.data, a2.scales * pairs.weight[q], a2.fmt)
        y = dequantize_groups(a2)[0].double() @ w2[e].T
        out[q] = y.float().to(torch.bfloat16).float()
    return out
