"""Independent block-FP8 arithmetic for the tests: numpy + ml_dtypes only, no project code.

vLLM's per_token_group_quant_fp8 on CUDA (its C++ kernel, use_ue8m0 off): scale = max(amax, 1e-10) / 448 in fp32,
q = clamp(x / scale, +-448) -> e4m3 RNE; DeepSeek's dequantisation: q * weight_scale_inv of its 128 x 128 block.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np


def np_group_quant(x: np.ndarray, group: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Independent: e4m3 bytes [..., K] and fp32 scales [..., K / group]."""
    g = x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // group, group)
    amax = np.maximum(np.abs(g).max(axis=-1), np.float32(1e-10)).astype(np.float32)
    scale = (amax / np.float32(448.0)).astype(np.float32)
    q = np.clip(g / scale[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(x.shape).view(np.uint8), scale


def np_block_dequant(q: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    vals = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    rep = np.repeat(np.repeat(scale_inv, 128, axis=-2), 128, axis=-1)
    return vals * rep


def np_stepwise_gemm(aq: np.ndarray, a_scale: np.ndarray, wq: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """A e4m3 bytes [M, K] (fp32 scales [M, K / 128]) x W e4m3 bytes [N, K] (block scales [N / 128, K / 128])^T
    -> fp32 [M, N], step by 128-wide K step as the Triton block-FP8 kernels add: the step's sum exact (fp64:
    128 e4m3 products are multiples of 2**-18 below 2**25) rounded to fp32, times the weight block's scale, times
    the A group's scale, added to an fp32 accumulator in K order."""
    a = aq.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    w = wq.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    acc = np.zeros((a.shape[0], w.shape[0]), dtype=np.float32)
    for s in range(a.shape[1] // 128):
        step = (a[:, s * 128:(s + 1) * 128] @ w[:, s * 128:(s + 1) * 128].T).astype(np.float32)
        w_s = np.repeat(w_scale[:, s].astype(np.float32), 128)[None, :]
        acc = acc + (step * w_s) * a_scale[:, s].astype(np.float32)[:, None]
    return acc


def np_stepwise_experts(x: np.ndarray, rows: np.ndarray, slots: np.ndarray, route_w: np.ndarray, w1q: np.ndarray,
                        w1s: np.ndarray, w2q: np.ndarray, w2s: np.ndarray, limit: float | None = None) -> np.ndarray:
    """The block-FP8 experts with the Triton kernels' arithmetic (np_stepwise_gemm), fp32 [P, H]: x fp32 [N, H]
    quantised per 1 x 128 group, GEMM1 over plain [gate; up] rows, SwiGLU (clamp: gate <= limit, |up| <= limit)
    as gate / (1 + exp(-gate)) * up in fp32, A2 re-quantised per group, GEMM2, times the route weight."""
    xq, xs = np_group_quant(x)
    out = np.zeros((len(rows), w2q.shape[1]), dtype=np.float32)
    inter = w2q.shape[2]
    for p in range(len(rows)):
        e, r = int(slots[p]), int(rows[p])
        if e < 0:
            continue
        h = np_stepwise_gemm(xq[r:r + 1], xs[r:r + 1], w1q[e], w1s[e])[0]
        gate, up = h[:inter], h[inter:]
        if limit is not None:
            gate = np.minimum(gate, np.float32(limit))
            up = np.clip(up, np.float32(-limit), np.float32(limit))
        act = gate / (np.float32(1.0) + np.exp(-gate)) * up
        aq, a_s = np_group_quant(act[None, :])
        out[p] = np_stepwise_gemm(aq, a_s, w2q[e], w2s[e])[0] * np.float32(route_w[p])
    return out
