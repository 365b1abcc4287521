"""Block-FP8 formats (formats/block_fp8.py) against an independent numpy + ml_dtypes implementation.

The independent side re-derives vLLM's per_token_group_quant_fp8 on CUDA (scale = max(amax, 1e-10) / 448,
q = clamp(x / scale, +-448) -> e4m3 RNE) and DeepSeek's 128x128 block dequantisation with no project code;
each check also fails on a planted mutation (a power-of-two scale, a 1x32 group, a transposed block grid).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from block_fp8_twin import np_block_dequant, np_group_quant

from megamoe_backend.formats import block_fp8 as bf


def _x(shape, seed=0, spread=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if spread:  # groups of very different magnitude, and one all-zero group
        x = x * torch.logspace(-3, 3, shape[-1] // 128).repeat_interleave(128)
        x[0, :128] = 0
    return x


def test_group_quant_matches_independent_bit_for_bit():
    x = _x((7, 512))
    t = bf.quantize_groups(x)
    q_ref, s_ref = np_group_quant(x.numpy())
    assert t.scales.dtype == torch.float32 and tuple(t.scales.shape) == (7, 4)
    assert np.array_equal(t.scales.numpy(), s_ref)
    assert np.array_equal(t.data.numpy(), q_ref)
    # scales are amax / 448, not powers of two (the MX rule): a planted power-of-two scale differs
    s = t.scales[t.scales > 1e-9]
    assert not torch.all(torch.frexp(s).mantissa == 0.5)
    pow2 = torch.exp2(torch.ceil(torch.log2(t.scales)))
    assert not np.array_equal(pow2.numpy(), s_ref)
    # planted: vLLM's Triton fallback rule, amax * fp32(1/448), is an ulp off in some groups
    amax = np.maximum(np.abs(x.numpy().reshape(7, 4, 128)).max(-1), np.float32(1e-10))
    assert not np.array_equal((amax * np.float32(1 / 448)).astype(np.float32), s_ref)
    deq = bf.dequantize_groups(t)
    ref = q_ref.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(7, 4, 128) * s_ref[..., None]
    assert np.array_equal(deq.numpy(), ref.reshape(7, 512))


def test_group_width_is_128_a_planted_32_differs():
    x = _x((3, 256), spread=False)
    q32, s32 = np_group_quant(x.numpy(), group=32)
    t = bf.quantize_groups(x)
    assert t.scales.shape[-1] == 2 and s32.shape[-1] == 8
    assert not np.array_equal(t.data.numpy(), q32)


def test_group_quant_nan_stays_in_its_group():
    x = _x((2, 384), spread=False)
    x[1, 130] = float("nan")
    deq = bf.dequantize_groups(bf.quantize_groups(x))
    assert torch.isnan(deq[1, 128:256]).all()
    assert torch.isfinite(deq[0]).all() and torch.isfinite(deq[1, :128]).all() and torch.isfinite(deq[1, 256:]).all()


def test_weight_blocks_round_trip_and_independent_dequant():
    w = _x((2, 256, 384), seed=1, spread=False) * 0.02
    w[1, 128:, :128] *= 1000  # one block far larger: its scale must not leak into neighbours
    q, s = bf.quantize_weight_blocks(w, "w1")
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (2, 2, 3) and s.dtype == torch.float32
    ours = bf.dequantize_weight_blocks(q, s, "w1")
    ref = np_block_dequant(q.view(torch.uint8).numpy(), s.numpy())
    assert np.array_equal(ours.numpy(), ref)
    # e4m3 has 3 mantissa bits: each element within half an ulp (2^-4 relative) of its block's grid
    err = (ours - w).abs() / w.abs().clamp_min(1e-30)
    assert float(err[w.abs() > s.repeat_interleave(128, -2).repeat_interleave(128, -1) * 64].max()) <= 2 ** -4
    # a planted transposed block grid (scale_inv[..., j, i]) dequantises differently
    planted = np_block_dequant(q.view(torch.uint8).numpy()[:, :, :256], np.swapaxes(s.numpy()[:, :, :2], -1, -2))
    assert not np.array_equal(planted, ref[:, :, :256])


@pytest.mark.parametrize("scale_shape,match", [
    ((2,), "per-tensor FP8 scales"),
    ((2, 1, 1), "per-tensor FP8 scales"),
    ((2, 2), "per-tensor FP8 scales"),  # vLLM's per-tensor Fp8MoEMethod: one scale per expert and gate/up shard
    ((2, 4, 6), r"not one scale per 128x128 block"),  # a 64x64 block grid
    ((2, 2, 6), r"not one scale per 128x128 block"),  # 128x64
])
def test_scale_layouts_other_than_128x128_are_refused_naming_the_tensor(scale_shape, match):
    q = torch.zeros(2, 256, 384, dtype=torch.float8_e4m3fn)
    with pytest.raises(bf.BlockFP8Error, match=match) as e:
        bf.dequantize_weight_blocks(q, torch.ones(scale_shape), "w13_weight")
    assert "w13_weight_scale_inv" in str(e.value)
    bf.check_weight_scale(q, torch.ones(2, 2, 3), "w13_weight")  # the right layout passes


def test_weight_block_size_refusals():
    bf.check_weight_block_size([128, 128], "config.json")
    with pytest.raises(bf.BlockFP8Error, match=r"weight_block_size \[64, 64\]"):
        bf.check_weight_block_size([64, 64], "config.json")
    with pytest.raises(bf.BlockFP8Error, match="per-tensor FP8 scales"):
        bf.check_weight_block_size(None, "config.json")


def test_sizes_not_multiple_of_128_are_refused():
    with pytest.raises(bf.BlockFP8Error, match="last dimension 96"):
        bf.quantize_groups(torch.zeros(2, 96))
    with pytest.raises(bf.BlockFP8Error, match="rows"):
        bf.quantize_weight_blocks(torch.zeros(1, 64, 128), "w2")
