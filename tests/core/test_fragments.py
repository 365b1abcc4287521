"""Fragment storage of MXFP4 weights (experts/fragments.py): pure torch, no Triton needed.

What the Triton frag decoder relies on, checked against independent math: the re-laid bytes round
trip exactly, and the four masked registers the kernel's PTX computes from each 32-bit word are
exactly (bf16 bits of value * 2**-126) of the right weights, for every e2m1 code.
"""

from __future__ import annotations

import pytest
import torch

from megamoe_backend.experts import ExpertMath, ExpertPairs, TorchReferenceExperts, quantize_expert_weights
from megamoe_backend.experts.fragments import (
    FragmentWeights,
    decode_words_reference,
    fp8_k_order,
    fp8_luts,
    from_fragments,
    to_fragments,
)
from megamoe_backend.formats import MXTensor, dequantize_mx


def _random_mxfp4(e, n, k, seed=0, lo=100, hi=140):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(lo, hi, (e, n, k // 32), generator=g, dtype=torch.uint8)
    return packed, scales


def _emulate_kernel(f: FragmentWeights) -> torch.Tensor:
    """fp64 [E, N, K] of what the frag mainloop computes: PTX registers (bf16 value * 2**-126) times the
    bf16 pair 2**(b - 127) of the stored scale byte b = s + 63, times the accumulator's 2**63."""
    e, rb, kb = f.words.shape[:3]
    regs = decode_words_reference(f.words.reshape(e, rb, kb, 32, 4, 4))  # [.., lane, step, 4 registers]
    halves = torch.stack((regs & 0xFFFF, (regs >> 16) & 0xFFFF), dim=-1).to(torch.int32)
    vals = (halves << 16).view(torch.float32).double()  # value * 2**-126, exactly
    # [.., g, c, step, h (X/Y), dr, dk] -> [e, rb, dr, g, kb, step, h, c, dk]
    vals = vals.reshape(e, rb, kb, 8, 4, 4, 2, 2, 2).permute(0, 1, 7, 3, 2, 5, 6, 4, 8).reshape(e, f.n, f.k)
    s = f.scales.to(torch.int64).reshape(e, rb, kb, 8, 2, 2).permute(0, 1, 5, 3, 2, 4).reshape(e, f.n, f.k // 32)
    pair = torch.pow(2.0, (s - 127).double()).repeat_interleave(32, dim=-1)
    return vals * pair * 2.0**63


def test_round_trip_and_every_code_decodes_exactly():
    packed, scales = _random_mxfp4(2, 48, 192)
    packed[0, 0, :8] = torch.arange(0, 256, 32, dtype=torch.uint8) | torch.arange(8, dtype=torch.uint8)  # all 16 codes
    f = to_fragments("w", packed, scales)
    assert f.words.shape == (2, 3, 3, 32, 16) and f.scales.shape == (2, 3, 3, 8, 4)
    back_p, back_s = from_fragments(f)
    assert torch.equal(back_p, packed) and torch.equal(back_s, scales)
    want = dequantize_mx(MXTensor(packed.reshape(-1, 96), scales.reshape(-1, 6), "fp4")).reshape(2, 48, 192).double()
    assert torch.equal(_emulate_kernel(f), want)


@pytest.mark.parametrize("n,k,match", [(40, 128, "multiple of 16"), (32, 96, "multiple of 64")])
def test_shapes_outside_fragments_raise(n, k, match):
    packed, scales = _random_mxfp4(1, n, k)
    with pytest.raises(ValueError, match=match):
        to_fragments("w2", packed, scales)


@pytest.mark.parametrize("lo,hi", [(10, 60), (190, 200)])
def test_scales_outside_the_exact_range_raise(lo, hi):
    packed, scales = _random_mxfp4(1, 16, 64, lo=lo, hi=hi)
    with pytest.raises(ValueError, match=r"w1_scale: E8M0 bytes span .* exact only for \[58, 191\]"):
        to_fragments("w1", packed, scales)


@pytest.mark.parametrize("layout", ["interleaved", "plain"])
def test_expert_weights_fragment_storage(layout):
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(3, 128, 64, generator=g), torch.randn(3, 64, 64, generator=g)
    w = quantize_expert_weights(w1, w2, "mxfp4", layout)
    f = w.as_fragments()
    assert f.storage == "fragments" and f.gate_up_layout == "interleaved"
    assert f.w1.shape == w.w1.shape and f.w1_scale.shape == w.w1_scale.shape  # same memory, re-laid
    assert f.as_fragments() is f
    back = f.as_rowmajor()
    if layout == "interleaved":
        assert torch.equal(back.w1, w.w1) and torch.equal(back.w1_scale, w.w1_scale)
    assert torch.equal(back.w2, w.w2) and torch.equal(back.w2_scale, w.w2_scale)
    # The reference provider reads either storage and gets the same numbers.
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    pairs = ExpertPairs(torch.arange(5).repeat_interleave(2), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0]), torch.rand(10, generator=g))
    ref = TorchReferenceExperts().forward(x, pairs, w, ExpertMath("bf16", 7.0))
    assert torch.equal(TorchReferenceExperts().forward(x, pairs, f, ExpertMath("bf16", 7.0)), ref)
    assert TorchReferenceExperts().prepare_weights(w) is w


def test_fragment_storage_rejects_what_it_cannot_hold():
    w = quantize_expert_weights(torch.randn(1, 64, 64), torch.randn(1, 64, 32), "bf16")
    with pytest.raises(ValueError, match="MXFP4"):
        w.as_fragments()
    m = quantize_expert_weights(torch.randn(1, 64, 64), torch.randn(1, 64, 32), "mxfp4", "plain")
    with pytest.raises(ValueError, match=r"holds \(\('mxfp4', 'interleaved'\),\) .* only, not \('mxfp4', 'plain'\)"):
        type(m)(m.w1, m.w2, "mxfp4", "plain", m.w1_scale, m.w2_scale, "fragments")
    with pytest.raises(ValueError, match="storage"):
        type(m)(m.w1, m.w2, "mxfp4", "plain", m.w1_scale, m.w2_scale, "columns")


def test_fp8_k_order_puts_each_lanes_step_in_one_block():
    """The fp8 kind's K order (fragments.fp8_k_order): a permutation inside every 128-wide chunk under
    which the wgmma e4m3 A fragment of lane c (MMA K positions 4c..4c+3 and 16+4c..16+4c+3 of each
    k32 step) covers exactly block c of the chunk, over the chunk's four k32 steps."""
    k = 384
    order = fp8_k_order(k)
    assert torch.equal(order.sort().values, torch.arange(k))
    assert torch.equal(order // 128, torch.arange(k) // 128)  # stays inside its chunk
    pos = torch.arange(k)
    lane_c = (pos % 16) // 4  # which lane column holds MMA position pos
    assert torch.equal((order % 128) // 32, lane_c)  # ... its weights all come from block lane_c
    with pytest.raises(ValueError, match="K % 128"):
        fp8_k_order(192)
    packed, scales = _random_mxfp4(1, 16, 192)
    with pytest.raises(ValueError, match="frag8 decoder .* K a multiple of 128"):
        to_fragments("w1", packed, scales, kind="fp8")


def test_fp8_kind_decodes_to_exact_e4m3():
    """fp8 kind: PRMT lookups through the tables the kernel builds from each block's S byte give e4m3
    bytes (torch.float8_e4m3fn) whose value times the row's row_scale is the dequantised weight, exactly,
    for every code and for block scales anywhere in the 11-binade span a row may hold; the bytes sit at
    the MMA K positions of fp8_k_order."""
    packed, scales = _random_mxfp4(2, 32, 256, seed=3, lo=110, hi=122)  # spans up to 11 binades
    packed[1, 3, :8] = torch.arange(0, 256, 32, dtype=torch.uint8) | torch.arange(8, dtype=torch.uint8)  # all 16 codes
    scales[0, 7] = torch.tensor([120, 109, 110, 115, 118, 111, 112, 119], dtype=torch.uint8)  # the widest span: 11 binades
    packed[0, 9, 16:32] = 0  # an all-zero block keeps no scale (its byte is free)
    scales[0, 9, 1] = 3
    f = to_fragments("w", packed, scales, kind="fp8")
    assert f.row_scale.dtype == torch.float32 and f.scales.max() <= 11
    back_p, back_s = from_fragments(f)
    live = torch.ones_like(scales, dtype=torch.bool)
    live[0, 9, 1] = False
    assert torch.equal(back_p, packed) and torch.equal(back_s[live], scales[live])
    e, rb, kb = f.words.shape[:3]
    assert f.scales.shape == (e, rb, kb // 2, 8, 4, 2)  # one S byte per (row, 128-wide step) per lane
    # tables per [e, rb, q, g, c, dr]; the same for both 64-wide halves kk and every word (j, b2) of the step
    lo, hi = fp8_luts(f.scales.reshape(e, rb, kb // 2, 1, 8, 4, 1, 1, 2))  # [.., q, kk, g, c, j, b2, dr]
    lo, hi = (t.expand(e, rb, kb // 2, 2, 8, 4, 2, 2, 2).reshape(e, rb, kb, 32, 4, 2) for t in (lo, hi))
    words = f.words.reshape(e, rb, kb, 32, 4, 4)  # [.., lane, word = 2 j + b2, byte]
    regs = decode_words_reference(words, kind="fp8", luts=((lo[..., 0], hi[..., 0]), (lo[..., 1], hi[..., 1])))
    byts = torch.stack([(regs >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)  # [.., lane, word, h, i]
    vals = byts.view(torch.float8_e4m3fn).double()
    # lane = 4 g + c, word = 2 b3 + b2 -> n = 8 h + g, MMA position 32 b3 + 16 b2 + 4 c + i
    vals = vals.reshape(e, rb, kb, 8, 4, 2, 2, 2, 4).permute(0, 1, 7, 3, 2, 5, 6, 4, 8).reshape(e, 32, 256)
    want = dequantize_mx(MXTensor(packed.reshape(-1, 128), scales.reshape(-1, 8), "fp4")).reshape(2, 32, 256).double()
    assert torch.equal(vals * f.row_scale.double()[..., None], want[..., fp8_k_order(256)])
    bad = scales.clone()
    bad[0, 0, 0] = 255
    with pytest.raises(ValueError, match=r"w_scale: E8M0 byte 255 \(NaN\)"):
        to_fragments("w", packed, bad, kind="fp8")
    wide = scales.clone()
    wide[1, 4, :4] = torch.tensor([130, 118, 125, 125], dtype=torch.uint8)  # 12 binades
    with pytest.raises(ValueError, match="expert 1 row 4 has block scales spanning more than 11 binades"):
        to_fragments("w", packed, wide, kind="fp8")
