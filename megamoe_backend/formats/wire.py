"""Wire row layouts: how one token's activation (dispatch) or one expert output (combine) travels.

A wire row is a flat uint8 row: the payload, then (for MX wires) the E8M0 scales. Transports move
rows as opaque bytes, so every transport (all_to_all, NVLink P2P, mori) carries the same layout and
the sender quantises exactly once per token, whatever the number of destination ranks.

Bytes per token at hidden 7168: bf16 14336; fp8 7168 + 224; fp4 3584 + 224. No padding is added:
hidden % 32 == 0 already keeps every row a multiple of 4 bytes for quantised wires (224 = 7168/32).
For block-FP8 experts the fp8 wire carries their A format instead (``mx`` "fp8_g128": e4m3, then one
fp32 scale per 1x128 group, little-endian bytes): 7168 + 224 bytes too, since 4 / 128 == 1 / 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_fp8 import A_FORMAT as FP8_G128
from .block_fp8 import FP8_BLOCK, GroupFP8Tensor, dequantize_groups, quantize_groups
from .mx import MX_BLOCK, MXTensor, dequantize_mx, quantize_mx

DISPATCH_WIRES = ("bf16", "fp8", "fp4")
COMBINE_WIRES = ("bf16", "fp8_blockwise_1x32")


@dataclass(frozen=True)
class WireFormat:
    """One row format: ``mx`` is None for bf16, else the A format ("fp8" / "fp4" MX, "fp8_g128" block-FP8)."""

    name: str
    mx: str | None

    def payload_bytes(self, hidden: int) -> int:
        if self.mx is None:
            return 2 * hidden
        return hidden if self.mx in ("fp8", FP8_G128) else hidden // 2

    def scale_bytes(self, hidden: int) -> int:
        if self.mx == FP8_G128:
            return 4 * (hidden // FP8_BLOCK)
        return 0 if self.mx is None else hidden // MX_BLOCK

    def row_bytes(self, hidden: int) -> int:
        return self.payload_bytes(hidden) + self.scale_bytes(hidden)

    def check_hidden(self, hidden: int, knob: str) -> None:
        if self.mx == FP8_G128 and hidden % FP8_BLOCK:
            raise ValueError(f"{knob}={self.name} for block-FP8 experts needs hidden % {FP8_BLOCK} == 0 (one fp32 scale "
                             f"per 1x{FP8_BLOCK} group), got hidden={hidden}; use the bf16 wire for this model")
        if self.mx is not None and hidden % MX_BLOCK != 0:
            raise ValueError(
                f"{knob}={self.name} needs hidden % {MX_BLOCK} == 0 (one E8M0 scale per 1x32 block), "
                f"got hidden={hidden}; use the bf16 wire for this model"
            )

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H] activations -> [N, row_bytes] uint8 rows (quantised once, here)."""
        if self.mx is None:
            return x.to(torch.bfloat16).contiguous().view(torch.uint8)
        if self.mx == FP8_G128:
            return encode_group_rows(quantize_groups(x, name="wire rows"))
        return encode_mx_rows(quantize_mx(x, self.mx, name="wire rows"))

    def decode(self, rows: torch.Tensor, hidden: int) -> torch.Tensor | MXTensor | GroupFP8Tensor:
        """[N, row_bytes] uint8 -> bf16 [N, H] or the quantised rows the expert GEMM consumes directly (copies)."""
        if rows.shape[-1] != self.row_bytes(hidden):
            raise ValueError(
                f"wire rows have {rows.shape[-1]} bytes, the {self.name} wire at hidden={hidden} "
                f"needs {self.row_bytes(hidden)}"
            )
        decoded = self.view(rows.contiguous(), hidden)
        if self.mx is None or self.mx == FP8_G128:
            return decoded
        return MXTensor(data=decoded.data.contiguous(), scales=decoded.scales.contiguous(), fmt=self.mx)

    def view(self, rows: torch.Tensor, hidden: int) -> torch.Tensor | MXTensor:
        """The same without a copy (the device forwards' fixed buffers): bf16 rows must be contiguous,
        MX rows may be the first row_bytes of wider rows (payload and scales are column views). Block-FP8 rows
        are column views too where the fp32 scales fall on 4-byte boundaries (the row stride and the offset
        multiples of 4: the device forward's buffers), else copied once."""
        if self.mx is None:
            return rows.view(torch.bfloat16)
        payload = self.payload_bytes(hidden)
        if self.mx == FP8_G128:  # fp32 scales need 4-byte aligned rows, else one contiguous copy
            aligned = rows.dim() == 2 and rows.stride(1) == 1 and rows.stride(0) % 4 == 0 and rows.storage_offset() % 4 == 0
            packed = rows if aligned else rows[:, : self.row_bytes(hidden)].contiguous()
            return GroupFP8Tensor(data=packed[:, :payload], scales=packed[:, payload : self.row_bytes(hidden)].view(torch.float32))
        return MXTensor(data=rows[:, :payload], scales=rows[:, payload : self.row_bytes(hidden)], fmt=self.mx)

    def decode_fp32(self, rows: torch.Tensor, hidden: int) -> torch.Tensor:
        decoded = self.decode(rows, hidden)
        if isinstance(decoded, GroupFP8Tensor):
            return dequantize_groups(decoded)
        if isinstance(decoded, MXTensor):
            return dequantize_mx(decoded)
        return decoded.to(torch.float32)


def encode_mx_rows(t: MXTensor) -> torch.Tensor:
    """MXTensor [N, ...] -> rows [N, payload + scales] (payload first)."""
    return torch.cat((t.data, t.scales), dim=-1).contiguous()


def encode_group_rows(t: GroupFP8Tensor) -> torch.Tensor:
    """GroupFP8Tensor [N, H] -> rows [N, H + 4 * H / 128] (e4m3 payload, then the fp32 scales' bytes)."""
    return torch.cat((t.data, t.scales.contiguous().view(torch.uint8)), dim=-1).contiguous()


def dispatch_wire(name: str, a_format: str | None = None) -> WireFormat:
    """MEGA_DISPATCH_WIRE ``name`` as rows; ``a_format`` (the experts' A format) says which fp8 rows "fp8" is:
    the block-FP8 experts' 1x128-group rows for "fp8_g128", MX rows otherwise."""
    if name not in DISPATCH_WIRES:
        raise ValueError(f"unknown dispatch wire {name!r}; allowed: {', '.join(DISPATCH_WIRES)}")
    if name == "fp8" and a_format == FP8_G128:
        return WireFormat(name=name, mx=FP8_G128)
    return WireFormat(name=name, mx=None if name == "bf16" else name)


def a_format_wire(a_format: str | None) -> WireFormat:
    """The rows that carry an A format as it is (None: bf16): what the device forwards' buffers hold."""
    if a_format is None:
        return dispatch_wire("bf16")
    return dispatch_wire("fp8" if a_format == FP8_G128 else a_format, a_format)


def combine_wire(name: str) -> WireFormat:
    if name not in COMBINE_WIRES:
        raise ValueError(f"unknown combine wire {name!r}; allowed: {', '.join(COMBINE_WIRES)}")
    return WireFormat(name=name, mx=None if name == "bf16" else "fp8")
