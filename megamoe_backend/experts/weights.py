"""One layer's local expert weights, in the layout every experts provider consumes.

Why one dataclass: providers (torch reference, Triton, aiter) and plugins (vLLM, SGLang loaders)
meet here. Plugins convert checkpoints into this; providers never look at checkpoint names.

Shapes (E = local experts on this rank, H = hidden, I = moe intermediate):
- bf16:  w1 [E, 2I, H] bf16, w2 [E, H, I] bf16, no scales.
- mxfp4: w1 [E, 2I, H // 2] uint8 (e2m1 pairs, even element in the low nibble),
         w1_scale [E, 2I, H // 32] uint8 E8M0; w2 [E, H, I // 2], w2_scale [E, H, I // 32].
GEMM1's output rows follow ``gate_up_layout``: "interleaved" = [g0, u0, g1, u1, ...] (what MegaMoE
kernels expect), "plain" = [g0 .. g_{I-1}, u0 .. u_{I-1}] (HF checkpoints' gate_proj; up_proj).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import MX_BLOCK, MXTensor, dequantize_mx, quantize_mx

WEIGHT_FORMATS = ("bf16", "mxfp4")
GATE_UP_LAYOUTS = ("interleaved", "plain")


@dataclass(frozen=True)
class ExpertWeights:
    w1: torch.Tensor
    w2: torch.Tensor
    fmt: str = "bf16"
    gate_up_layout: str = "interleaved"
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.fmt not in WEIGHT_FORMATS:
            raise ValueError(f"ExpertWeights.fmt={self.fmt!r}; expected one of {WEIGHT_FORMATS}")
        if self.gate_up_layout not in GATE_UP_LAYOUTS:
            raise ValueError(f"ExpertWeights.gate_up_layout={self.gate_up_layout!r}; expected one of {GATE_UP_LAYOUTS}")
        e, two_i, h_packed = self.w1.shape
        if two_i % 2:
            raise ValueError(f"w1 has {two_i} output rows; gate+up needs an even count (2 * intermediate)")
        h = h_packed * (2 if self.fmt == "mxfp4" else 1)
        i = two_i // 2
        packing = 2 if self.fmt == "mxfp4" else 1
        expect_w2 = (e, h, i // packing)
        if tuple(self.w2.shape) != expect_w2:
            raise ValueError(f"w2 has shape {tuple(self.w2.shape)}, expected {expect_w2} for w1 {tuple(self.w1.shape)}")
        if self.fmt == "bf16":
            for name in ("w1", "w2"):
                t = getattr(self, name)
                if t.dtype != torch.bfloat16:
                    raise ValueError(f"{name} must be bfloat16 for fmt='bf16', got {t.dtype}")
        else:
            for name, scale_name, rows, k in (("w1", "w1_scale", two_i, h), ("w2", "w2_scale", h, i)):
                t, s = getattr(self, name), getattr(self, scale_name)
                if t.dtype != torch.uint8:
                    raise ValueError(f"{name} must be uint8 (packed e2m1) for fmt='mxfp4', got {t.dtype}")
                if k % MX_BLOCK:
                    raise ValueError(f"{name}: reduction dim {k} is not a multiple of {MX_BLOCK}")
                if s is None or s.dtype != torch.uint8 or tuple(s.shape) != (e, rows, k // MX_BLOCK):
                    got = None if s is None else (tuple(s.shape), s.dtype)
                    raise ValueError(f"{scale_name} must be uint8 of shape {(e, rows, k // MX_BLOCK)}, got {got}")

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w1.shape[1] // 2

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1, w2) in fp32, same row order as stored."""
        if self.fmt == "bf16":
            return self.w1.float(), self.w2.float()
        w1 = dequantize_mx(MXTensor(self.w1, self.w1_scale, "fp4"))
        w2 = dequantize_mx(MXTensor(self.w2, self.w2_scale, "fp4"))
        return w1, w2

    def to(self, device: torch.device | str) -> "ExpertWeights":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return ExpertWeights(move(self.w1), move(self.w2), self.fmt, self.gate_up_layout, move(self.w1_scale), move(self.w2_scale))


def interleave_gate_up(gate_up_plain: torch.Tensor) -> torch.Tensor:
    """[..., 2I, K] plain [gate; up] rows -> interleaved [g0, u0, g1, u1, ...] rows."""
    two_i = gate_up_plain.shape[-2]
    gate, up = gate_up_plain.split(two_i // 2, dim=-2)
    return torch.stack((gate, up), dim=-2).reshape(gate_up_plain.shape)


def deinterleave_gate_up(gate_up_interleaved: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleave_gate_up`."""
    shape = gate_up_interleaved.shape
    pairs = gate_up_interleaved.reshape(*shape[:-2], shape[-2] // 2, 2, shape[-1])
    return torch.cat((pairs[..., 0, :], pairs[..., 1, :]), dim=-2)


def quantize_expert_weights(w1: torch.Tensor, w2: torch.Tensor, fmt: str, gate_up_layout: str = "interleaved") -> ExpertWeights:
    """bf16/fp32 weights [E, 2I, H], [E, H, I] -> ExpertWeights in ``fmt`` (MXFP4 along K)."""
    if fmt == "bf16":
        return ExpertWeights(w1.to(torch.bfloat16).contiguous(), w2.to(torch.bfloat16).contiguous(), "bf16", gate_up_layout)
    if fmt != "mxfp4":
        raise ValueError(f"fmt={fmt!r}; expected one of {WEIGHT_FORMATS}")
    q1 = quantize_mx(w1, "fp4", name="w1")
    q2 = quantize_mx(w2, "fp4", name="w2")
    return ExpertWeights(q1.data, q2.data, "mxfp4", gate_up_layout, q1.scales, q2.scales)
