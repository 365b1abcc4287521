"""MX formats, bit for bit, against an independent implementation (ml_dtypes + numpy in float64).

The reference below computes the scale exponent with exact float64 math (math.frexp) and casts
with ml_dtypes' float8_e4m3fn / float4_e2m1fn / float8_e8m0fnu — no code shared with
megamoe_backend.formats.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_backend.formats import (
    MXTensor,
    decode_e8m0,
    dequantize_mx,
    dispatch_wire,
    combine_wire,
    pack_fp4,
    quantize_mx,
    unpack_fp4,
)

MAX_POS = {"fp8": 448.0, "fp4": 6.0}
NP_DTYPE = {"fp8": ml_dtypes.float8_e4m3fn, "fp4": ml_dtypes.float4_e2m1fn}


def ref_quantize(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Independent MX quantisation: returns (element bit codes per element, scale bytes)."""
    rows, k = x.shape
    codes = np.zeros((rows, k), dtype=np.uint8)
    scales = np.zeros((rows, k // 32), dtype=np.uint8)
    for r in range(rows):
        for b in range(k // 32):
            blk = x[r, 32 * b : 32 * b + 32].astype(np.float64)
            amax = np.max(np.abs(blk))
            if not np.isfinite(amax):
                scales[r, b] = 0xFF
                continue
            ratio = np.float32(np.float32(amax) / np.float32(MAX_POS[fmt]))
            if ratio == 0:  # amax 0, or so small (fp32 subnormal) that amax / max_pos < 2**-149: far below 2**-127
                e = -127
            else:
                m, ex = math.frexp(float(ratio))
                e = ex - 1 if m == 0.5 else ex
                e = max(-127, min(127, e))
            scales[r, b] = e + 127
            assert ml_dtypes.float8_e8m0fnu(2.0**e).view(np.uint8) == e + 127
            scaled = (blk / 2.0**e).astype(np.float32)
            codes[r, 32 * b : 32 * b + 32] = scaled.astype(NP_DTYPE[fmt]).view(np.uint8)
    return codes, scales


def our_codes(q: MXTensor) -> np.ndarray:
    data = q.data if q.fmt == "fp8" else unpack_fp4(q.data)
    return data.numpy()


def test_underflowing_amax_gets_the_smallest_scale() -> None:
    """A block whose largest magnitude is an fp32 subnormal so small that amax / max_pos is below
    2**-149 (found by hypothesis): scale 2**-127 (byte 0), every element rounds to zero."""
    x = torch.zeros(1, 32)
    x[0, 31] = 2.8e-44
    for fmt in ("fp8", "fp4"):
        q = quantize_mx(x, fmt)
        assert q.scales.item() == 0
        assert (dequantize_mx(q) == 0).all()
        assert ref_quantize(x.numpy(), fmt)[1][0, 0] == 0


def edge_tensor() -> torch.Tensor:
    x = torch.randn(8, 128) * 4
    x[0] = 0.0  # all-zero row (every block zero)
    x[1, :32] = 1e-40  # fp32 subnormals
    x[1, 32:64] = torch.linspace(-1e-38, 1e-38, 32)
    x[2, :32] = torch.finfo(torch.float32).max / 2  # near fp32 max
    x[2, 40] = 448.0
    x[2, 70] = 6.0
    x[3, 5] = float("nan")
    x[4, 33] = float("inf")
    x[4, 100] = float("-inf")
    x[5] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 16)  # fp4 ties (scale 1)
    x[5, 31] = 6.0
    x[6] = -0.0
    x[7] *= 1e-30
    return x


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("source", ["random", "edges", "bf16"])
def test_quantize_bit_exact_vs_ml_dtypes(fmt: str, source: str) -> None:
    if source == "random":
        x = torch.randn(16, 256) * torch.logspace(-3, 3, 16).unsqueeze(1)
    elif source == "edges":
        x = edge_tensor()
    else:
        x = (torch.randn(16, 256) * 3).to(torch.bfloat16).float()
    q = quantize_mx(x, fmt)
    ref_codes, ref_scales = ref_quantize(x.numpy(), fmt)
    np.testing.assert_array_equal(q.scales.numpy(), ref_scales)
    finite_blocks = np.repeat(ref_scales != 0xFF, 32, axis=1)
    np.testing.assert_array_equal(our_codes(q)[finite_blocks], ref_codes[finite_blocks])


def test_nan_and_inf_stay_in_their_block() -> None:
    x = edge_tensor()
    for fmt in ("fp8", "fp4"):
        d = dequantize_mx(quantize_mx(x, fmt))
        assert torch.isnan(d[3, :32]).all() and torch.isfinite(d[3, 32:]).all()
        assert torch.isnan(d[4, 32:64]).all() and torch.isnan(d[4, 96:128]).all()
        assert torch.isfinite(d[4, :32]).all() and torch.isfinite(d[4, 64:96]).all()
        assert torch.isfinite(d[[0, 1, 2, 5, 6, 7]]).all()
        assert (d[0] == 0).all()


def test_fp4_packing_even_element_in_low_nibble() -> None:
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_fp4(packed), codes)
    # amax 1.0 -> 1/6 rounded up to 2**-2 (byte 125); 0.5 / 0.25 = 2.0 (code 4) sits in the LOW
    # nibble, 1.0 / 0.25 = 4.0 (code 6) in the high nibble: byte 0x64.
    q = quantize_mx(torch.tensor([[0.5, 1.0] + [0.0] * 30]), "fp4")
    assert q.scales.item() == 125
    assert q.data[0, 0].item() == 0x64
    assert ml_dtypes.float4_e2m1fn(2.0).view(np.uint8) & 0xF == 0x4


def test_e8m0_decode_matches_torch_e8m0_dtype() -> None:
    b = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8)
    ours = decode_e8m0(b)
    theirs = b.view(torch.float8_e8m0fnu).to(torch.float32)
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    finite = ~torch.isnan(ours)
    assert torch.equal(ours[finite], theirs[finite])


def test_fp8_matches_torch_float8_cast_at_scale_one() -> None:
    x = torch.rand(4, 64) * 448.0
    x[:, 0] = 448.0  # forces scale 2**0
    q = quantize_mx(x, "fp8")
    assert (q.scales == 127).all()
    assert torch.equal(q.data, x.to(torch.float8_e4m3fn).view(torch.uint8))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32), min_size=32, max_size=32),
    st.sampled_from(["fp8", "fp4"]),
)
def test_property_scaled_values_within_range_and_exact(values: list[float], fmt: str) -> None:
    x = torch.tensor([values], dtype=torch.float32)
    q = quantize_mx(x, fmt)
    ref_codes, ref_scales = ref_quantize(x.numpy(), fmt)
    assert q.scales.item() == ref_scales[0, 0]
    np.testing.assert_array_equal(our_codes(q), ref_codes)
    d = dequantize_mx(q)
    # dequantised magnitude never exceeds amax rounded to the scale grid
    assert float(d.abs().max()) <= float(x.abs().max()) * (1 + 1e-6) + 2.0 ** (q.scales.item() - 127) * MAX_POS[fmt]


def test_wire_row_layout_and_bytes() -> None:
    h = 7168
    assert dispatch_wire("bf16").row_bytes(h) == 14336
    assert (dispatch_wire("fp8").payload_bytes(h), dispatch_wire("fp8").scale_bytes(h)) == (7168, 224)
    assert (dispatch_wire("fp4").payload_bytes(h), dispatch_wire("fp4").scale_bytes(h)) == (3584, 224)
    assert combine_wire("fp8_blockwise_1x32").row_bytes(h) == 7168 + 224
    x = torch.randn(3, 64)
    for name in ("fp8", "fp4"):
        w = dispatch_wire(name)
        rows = w.encode(x)
        q = quantize_mx(x, name)
        # payload first, then the E8M0 scales
        assert torch.equal(rows[:, : w.payload_bytes(64)], q.data)
        assert torch.equal(rows[:, w.payload_bytes(64) :], q.scales)
        assert torch.equal(w.decode_fp32(rows, 64), dequantize_mx(q))


def test_hidden_not_multiple_of_32_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of the MX block"):
        quantize_mx(torch.randn(2, 48), "fp8")
    with pytest.raises(ValueError, match="hidden % 32"):
        dispatch_wire("fp4").check_hidden(100, "MEGA_DISPATCH_WIRE")
