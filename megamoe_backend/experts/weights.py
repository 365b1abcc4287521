"""One layer's local expert weights, in the layout every experts provider consumes.

Why one dataclass: providers (torch reference, Triton, aiter) and plugins (vLLM, SGLang loaders)
meet here. Plugins convert checkpoints into this; providers never look at checkpoint names.

Shapes (E = local experts on this rank, H = hidden, I = moe intermediate):
- bf16:  w1 [E, 2I, H] bf16, w2 [E, H, I] bf16, no scales.
- mxfp4: w1 [E, 2I, H // 2] uint8 (e2m1 pairs, even element in the low nibble),
         w1_scale [E, 2I, H // 32] uint8 E8M0; w2 [E, H, I // 2], w2_scale [E, H, I // 32].
- fp8_block (DeepSeek V3 / R1 FP8): w1 [E, 2I, H] float8_e4m3fn, w1_scale [E, 2I / 128, H / 128] fp32
         (the checkpoint's ``weight_scale_inv``, one per 128 x 128 block); w2 [E, H, I], w2_scale
         [E, H / 128, I / 128]. gate/up rows "plain" only: a 128-row block of the checkpoint covers
         gate_proj rows or up_proj rows, which interleaving would split (formats/block_fp8.py).
GEMM1's output rows follow ``gate_up_layout``: "interleaved" = [g0, u0, g1, u1, ...] (what MegaMoE
kernels expect), "plain" = [g0 .. g_{I-1}, u0 .. u_{I-1}] (HF checkpoints' gate_proj; up_proj).

``storage`` says how the MXFP4 bytes are ordered: "rowmajor" (checkpoint order, what every provider
reads), "fragments" (the same bytes re-laid as Hopper bf16 MMA register fragments by
``as_fragments()``, what the Triton ``frag`` decoder reads) or "fragments_fp8" (re-laid for the FP8
MMA, ``as_fragments("fp8")``, the ``frag8`` decoder, which also keeps one fp32 power-of-two scale per
weight row in ``w1_row_scale`` [E, 2I] / ``w2_row_scale`` [E, H]); see experts/fragments.py. "humming":
humming-kernels' repacked W4A8 layout (experts/humming/weights.py), whose block scales are folded into
the weights relative to one scale per weight row (bf16, in humming's epilogue order) held in the same
row-scale fields; its inverse is humming's, on the GPU, so it has no ``as_rowmajor()`` here. Block-FP8
weights in "humming" storage are humming's repacked e4m3 bytes and its reordering of the fp32 block scales (the
same shapes, plain gate/up rows, no row scales).
Every storage keeps the tensor shapes above, so a layer holds one copy of its weights either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import MX_BLOCK, MXTensor, dequantize_mx, quantize_mx
from ..formats.block_fp8 import check_weight_scale, dequantize_weight_blocks, quantize_weight_blocks

WEIGHT_FORMATS = ("bf16", "mxfp4", "fp8_block")
GATE_UP_LAYOUTS = ("interleaved", "plain")
STORAGES = ("rowmajor", "fragments", "fragments_fp8", "humming")
ROW_SCALED = ("fragments_fp8", "humming")  # storages that keep a scale per weight row (w1_row_scale, w2_row_scale)
# (fmt, gate_up_layout) each storage but "rowmajor" holds: the fragment storages and humming's W4A8 layout hold
# MXFP4 with interleaved gate/up rows; humming's block-FP8 layout holds the checkpoint's plain rows
STORED_FORMS = {"fragments": (("mxfp4", "interleaved"),), "fragments_fp8": (("mxfp4", "interleaved"),),
                "humming": (("mxfp4", "interleaved"), ("fp8_block", "plain"))}
FRAGMENT_STORAGE = {"bf16": "fragments", "fp8": "fragments_fp8"}  # fragment kind -> storage name
# the per-expert tensor fields, in the order expert_tensors() returns them
EXPERT_FIELDS = ("w1", "w2", "w1_scale", "w2_scale", "w1_row_scale", "w2_row_scale")


@dataclass(frozen=True)
class ExpertWeights:
    w1: torch.Tensor
    w2: torch.Tensor
    fmt: str = "bf16"
    gate_up_layout: str = "interleaved"
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    storage: str = "rowmajor"
    w1_row_scale: torch.Tensor | None = None  # fragments_fp8: fp32 [E, 2I]; humming: bf16 [E, 2I]
    w2_row_scale: torch.Tensor | None = None  # fragments_fp8: fp32 [E, H]; humming: bf16 [E, H]

    def __post_init__(self) -> None:
        if self.storage not in STORAGES:
            raise ValueError(f"ExpertWeights.storage={self.storage!r}; expected one of {STORAGES}")
        for name, rows in (("w1_row_scale", self.w1.shape[:2]), ("w2_row_scale", self.w2.shape[:2])):
            t = getattr(self, name)
            if (t is not None) != (self.storage in ROW_SCALED and self.fmt == "mxfp4"):
                raise ValueError(f"ExpertWeights.{name} is set exactly for MXFP4 weights in storages {ROW_SCALED} "
                                 f"(storage={self.storage!r}, fmt={self.fmt!r})")
            dtype = torch.float32 if self.storage == "fragments_fp8" else torch.bfloat16
            if t is not None and (t.dtype != dtype or tuple(t.shape) != tuple(rows)):
                raise ValueError(f"ExpertWeights.{name}: expected {dtype} {tuple(rows)}, got {t.dtype} {tuple(t.shape)}")
        if self.storage != "rowmajor" and (self.fmt, self.gate_up_layout) not in STORED_FORMS[self.storage]:
            raise ValueError(f"storage {self.storage!r} holds {STORED_FORMS[self.storage]} (fmt, gate/up layout) only, "
                             f"not ({self.fmt!r}, {self.gate_up_layout!r})")
        if self.fmt not in WEIGHT_FORMATS:
            raise ValueError(f"ExpertWeights.fmt={self.fmt!r}; expected one of {WEIGHT_FORMATS}")
        if self.gate_up_layout not in GATE_UP_LAYOUTS:
            raise ValueError(f"ExpertWeights.gate_up_layout={self.gate_up_layout!r}; expected one of {GATE_UP_LAYOUTS}")
        if self.fmt == "fp8_block":
            self._check_fp8_block()
            return
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

    def _check_fp8_block(self) -> None:
        """Shapes, dtypes and one fp32 scale per 128 x 128 block (per-tensor scales refused, naming the tensor)."""
        if self.gate_up_layout != "plain":
            raise ValueError("block-FP8 w1 must keep the checkpoint's plain [gate; up] rows (gate_up_layout='plain'): "
                             "each 128-row scale block covers gate_proj or up_proj rows, interleaving would split it")
        e, two_i, h = self.w1.shape
        expect_w2 = (e, h, two_i // 2)
        if two_i % 2 or tuple(self.w2.shape) != expect_w2:
            raise ValueError(f"w2 has shape {tuple(self.w2.shape)}, expected {expect_w2} for w1 {tuple(self.w1.shape)}")
        for name in ("w1", "w2"):
            t = getattr(self, name)
            if t.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{name} must be float8_e4m3fn for fmt='fp8_block', got {t.dtype}")
            check_weight_scale(t, getattr(self, f"{name}_scale"), name)
        if (two_i // 2) % 128:  # gate and up each whole blocks (also what vLLM's block-FP8 MoE needs)
            raise ValueError(f"block-FP8 intermediate size {two_i // 2} is not a multiple of 128")

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    def expert_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor set here, by field name: one row per local expert, each contiguous.

        What an engine's EPLB moves between ranks as ``[experts, -1]`` views: all fields of every
        storage are expert-major (fragment storage re-lays bytes within an expert only), so moving
        an expert's rows moves the whole expert, scales and row scales included.
        """
        out = {}
        for name in EXPERT_FIELDS:
            t = getattr(self, name)
            if t is None:
                continue
            if t.shape[0] != self.num_experts or not t.is_contiguous():
                raise ValueError(f"ExpertWeights.{name} {tuple(t.shape)} is not a contiguous tensor with one row per "
                                 f"expert ({self.num_experts}); EPLB cannot move it as [experts, -1] rows")
            out[name] = t
        return out

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w1.shape[1] // 2

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1, w2) in fp32, same row order as stored (rowmajor, whatever the storage)."""
        if self.fmt == "bf16":
            return self.w1.float(), self.w2.float()
        if self.storage != "rowmajor" and self.fmt == "fp8_block":
            return self.as_rowmajor().dequantized()  # humming's bytes: it has no row-major form here (raises, naming it)
        if self.fmt == "fp8_block":
            return (dequantize_weight_blocks(self.w1, self.w1_scale, "w1"),
                    dequantize_weight_blocks(self.w2, self.w2_scale, "w2"))
        if self.storage != "rowmajor":
            return self.as_rowmajor().dequantized()
        w1 = dequantize_mx(MXTensor(self.w1, self.w1_scale, "fp4"))
        w2 = dequantize_mx(MXTensor(self.w2, self.w2_scale, "fp4"))
        return w1, w2

    def to(self, device: torch.device | str) -> "ExpertWeights":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return ExpertWeights(move(self.w1), move(self.w2), self.fmt, self.gate_up_layout, move(self.w1_scale), move(self.w2_scale),
                             self.storage, move(self.w1_row_scale), move(self.w2_row_scale))

    def as_fragments(self, kind: str = "bf16") -> "ExpertWeights":
        """MXFP4 weights in MMA-fragment byte order for ``kind`` "bf16" (frag decoder) or "fp8" (frag8),
        gate/up interleaved first; raises ValueError naming the tensor when a shape or a scale is
        outside what that decoder handles."""
        from .fragments import to_fragments

        storage = FRAGMENT_STORAGE.get(kind)  # an unknown kind: to_fragments names the choices
        if self.storage == storage:
            return self
        if self.fmt != "mxfp4":
            raise ValueError(f"fragment storage is for MXFP4 weights, these are {self.fmt}")
        src = self.as_rowmajor()
        w1, s1 = src.w1, src.w1_scale
        if src.gate_up_layout == "plain":
            w1, s1 = interleave_gate_up(w1), interleave_gate_up(s1)
        f1, f2 = to_fragments("w1", w1, s1, kind), to_fragments("w2", src.w2, src.w2_scale, kind)
        return ExpertWeights(f1.words.view(self.w1.shape), f2.words.view(self.w2.shape), "mxfp4", "interleaved",
                             f1.scales.view(self.w1_scale.shape), f2.scales.view(self.w2_scale.shape), storage,
                             f1.row_scale, f2.row_scale)

    def as_rowmajor(self) -> "ExpertWeights":
        """Inverse of as_fragments (gate/up stay interleaved)."""
        from .fragments import FRAG_K, FRAG_ROWS, FragmentWeights, from_fragments, scale_shape

        if self.storage == "rowmajor":
            return self
        if self.storage == "humming":
            raise ValueError("ExpertWeights in humming storage (humming-kernels' repacked layout) have no row-major form "
                             "here: humming's own dequantisation runs on the GPU; keep the row-major weights to read them")
        kind = next(k for k, st in FRAGMENT_STORAGE.items() if st == self.storage)
        out = []
        for w, s, rs in ((self.w1, self.w1_scale, self.w1_row_scale), (self.w2, self.w2_scale, self.w2_row_scale)):
            e, n, k2 = w.shape
            k = 2 * k2
            words = w.view(e, n // FRAG_ROWS, k // FRAG_K, 32, 16)
            scales = s.view(scale_shape(kind, e, n, k))
            out.extend(from_fragments(FragmentWeights(words, scales, n, k, kind, rs)))
        return ExpertWeights(out[0], out[2], "mxfp4", "interleaved", out[1], out[3])


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
    """bf16/fp32 weights [E, 2I, H], [E, H, I] -> ExpertWeights in ``fmt`` (MXFP4 along K, or block-FP8)."""
    if fmt == "bf16":
        return ExpertWeights(w1.to(torch.bfloat16).contiguous(), w2.to(torch.bfloat16).contiguous(), "bf16", gate_up_layout)
    if fmt == "fp8_block":  # 128 x 128 blocks over the plain [gate; up] rows, as the checkpoints hold them
        if gate_up_layout != "plain":
            raise ValueError("block-FP8 weights are quantised over plain [gate; up] rows: pass gate_up_layout='plain'")
        q1, s1 = quantize_weight_blocks(w1, "w1")
        q2, s2 = quantize_weight_blocks(w2, "w2")
        return ExpertWeights(q1, q2, "fp8_block", "plain", s1, s2)
    if fmt != "mxfp4":
        raise ValueError(f"fmt={fmt!r}; expected one of {WEIGHT_FORMATS}")
    q1 = quantize_mx(w1, "fp4", name="w1")
    q2 = quantize_mx(w2, "fp4", name="w2")
    return ExpertWeights(q1.data, q2.data, "mxfp4", gate_up_layout, q1.scales, q2.scales)
