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
