"""Number formats: E8M0 scales, MXFP8 / MXFP4 block quantisation, block-FP8, and wire row layouts."""

from .a_format import A_FORMATS, dequantize_a, fake_quantize_a
from .block_fp8 import GroupFP8Tensor
from .e8m0 import decode_e8m0, encode_e8m0, scale_exponent_for_amax
from .mx import (
    FP4_MAX,
    FP8_MAX,
    MX_BLOCK,
    MXTensor,
    dequantize_mx,
    fake_quantize,
    pack_fp4,
    quantize_mx,
    unpack_fp4,
)
from .wire import COMBINE_WIRES, DISPATCH_WIRES, WireFormat, combine_wire, dispatch_wire

__all__ = [
    "A_FORMATS",
    "GroupFP8Tensor",
    "dequantize_a",
    "fake_quantize_a",
    "COMBINE_WIRES",
    "DISPATCH_WIRES",
    "FP4_MAX",
    "FP8_MAX",
    "MX_BLOCK",
    "MXTensor",
    "WireFormat",
    "combine_wire",
    "decode_e8m0",
    "dequantize_mx",
    "dispatch_wire",
    "encode_e8m0",
    "fake_quantize",
    "pack_fp4",
    "quantize_mx",
    "scale_exponent_for_amax",
    "unpack_fp4",
]
