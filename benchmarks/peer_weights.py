"""The project's MXFP4 expert weights re-laid as each peer's documented logical layout.

Why: the peer figures of ``megamoe bench experts / layer --peers`` (benchmarks/peers.py) must run the SAME
MXFP4 weights the project runs, so that their relL2 against the project's fp32 reference (fp32 math on
the dequantised weights) measures the peer's arithmetic, not a second quantisation. Each peer's own
load-time preparation (FlashInfer's ``*Config.prepare_weights``, vLLM's ``_swizzle_mxfp4``) starts from
bf16 weights and quantises them itself; here the already-quantised codes and E8M0 scales are moved
into the layout that preparation produces just before its device-side swizzles, and the peer's own
swizzle functions run on top of that (on the GPU: benchmarks/peers.py). No value is re-rounded: every byte
of a code or a scale is one of the project's.

The project's layout (experts/weights.py): w1 ``[E, 2I, H/2]`` uint8, two e2m1 codes per byte, the
EVEN element in the LOW nibble; E8M0 scales ``[E, rows, K/32]`` row-major; GEMM1 rows gate/up
"interleaved" ``[g0, u0, g1, u1, ...]`` (or "plain" ``[gate; up]``).

- FlashInfer (``flashinfer.fused_moe``, 0.7.2.post1): ``MoEWeightPack``'s canonical gated w1 is
  ``[E, 2I, H]`` with rows ``[up; gate]`` (``act(x @ w1[I:].T) * (x @ w1[:I].T)``); its MXFP4 quantiser
  (``prepare._quantize_mxfp4_linear``) packs the even element in the low nibble and writes linear
  row-major ``[rows, K/32]`` UE8M0 bytes (exponent + 127). Same nibble order and scale bytes as the
  project: only the GEMM1 rows move. Humming's E8M0 range clamp and both SM90 interleaves run on top.
- FlashInfer 0.7.4's SM90 MXFP4 x FP8 fused MegaMoE (``flashinfer.moe_ep``, backend
  ``fp8_mxfp4_bf16_pull_cutedsl``): ``PrequantizedMoEWeights`` with the raw packed E2M1 payload and raw
  K32 E8M0 exponent bytes, FC1 rows "gate followed by up" (its config's docstring; its weights.py then
  interleaves them in groups of 8, ``_interleave_gate_up_8``, before Humming's preprocessing), the even
  element in the low nibble (its tests pack ``codes[0::2] | codes[1::2] << 4``). Only the GEMM1 rows
  move; FlashInfer's own ``preprocess_weights`` (the Humming range clamp, the fold, the SM90 interleave)
  runs on top when the layer is built.
- triton_kernels (``matmul_ogs``, Triton 3.6's snapshot), as vLLM's ``_swizzle_mxfp4`` feeds it: the
  checkpoint tensors ``[E, N, K/2]`` / ``[E, N, K/32]`` transposed to ``[E, K/2, N]`` / ``[E, K/32, N]``
  (quantisation axis on dim 1, ``mx_axis=1``), GEMM1 columns gate/up interleaved (its fused SwiGLU
  splits even / odd columns): the project's interleaved rows as they are. Hopper value / scale
  swizzles (``convert_layout``) run on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe_backend.experts import ExpertWeights
from megamoe_backend.experts.weights import deinterleave_gate_up, interleave_gate_up


@dataclass(frozen=True)
class FlashInferMxfp4:
    """Logical MXFP4 in FlashInfer's canonical order (module docstring), before its SM90 interleaves."""

    w1: torch.Tensor  # uint8 [E, 2I, H/2], rows [up; gate]
    w1_scale: torch.Tensor  # uint8 E8M0 [E, 2I, H/32]
    w2: torch.Tensor  # uint8 [E, H, I/2]
    w2_scale: torch.Tensor  # uint8 E8M0 [E, H, I/32]


@dataclass(frozen=True)
class FlashInferMegaMxfp4:
    """Raw MXFP4 as FlashInfer's SM90 MegaMoE takes it in ``PrequantizedMoEWeights`` (module docstring)."""

    w13: torch.Tensor  # uint8 [E, 2I, H/2], rows [gate; up]
    w13_scale: torch.Tensor  # uint8 E8M0 [E, 2I, H/32]
    w2: torch.Tensor  # uint8 [E, H, I/2]
    w2_scale: torch.Tensor  # uint8 E8M0 [E, H, I/32]


@dataclass(frozen=True)
class TritonKernelsMxfp4:
    """Logical MXFP4 as matmul_ogs takes it (module docstring): K-major views, before the Hopper swizzles."""

    w1: torch.Tensor  # uint8 [E, H/2, 2I] (a transposed view), columns gate/up interleaved
    w1_scale: torch.Tensor  # uint8 E8M0 [E, H/32, 2I]
    w2: torch.Tensor  # uint8 [E, I/2, H]
    w2_scale: torch.Tensor  # uint8 E8M0 [E, I/32, H]


def _rowmajor_mxfp4(w: ExpertWeights, peer: str) -> ExpertWeights:
    if w.fmt != "mxfp4":
        raise ValueError(f"{peer} peer weights: need the project's MXFP4 expert weights, got fmt={w.fmt!r} "
                         "(bench weights come from bench_experts.make_weights)")
    return w.as_rowmajor()


def _interleaved(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "interleaved" else interleave_gate_up(t)


def _up_then_gate(t: torch.Tensor, layout: str) -> torch.Tensor:
    """GEMM1 rows [E, 2I, ...] in the project's ``layout`` -> FlashInfer's [up; gate]."""
    t = _interleaved(t, layout)
    return torch.cat((t[:, 1::2], t[:, 0::2]), dim=1).contiguous()


def to_flashinfer(w: ExpertWeights) -> FlashInferMxfp4:
    """The project's MXFP4 weights in FlashInfer's canonical logical layout (bytes unchanged, rows moved)."""
    w = _rowmajor_mxfp4(w, "FlashInfer")
    return FlashInferMxfp4(_up_then_gate(w.w1, w.gate_up_layout), _up_then_gate(w.w1_scale, w.gate_up_layout),
                           w.w2.contiguous(), w.w2_scale.contiguous())


def _gate_then_up(t: torch.Tensor, layout: str) -> torch.Tensor:
    """GEMM1 rows [E, 2I, ...] in the project's ``layout`` -> [gate; up], contiguous."""
    return (deinterleave_gate_up(t) if layout == "interleaved" else t).contiguous()


def to_flashinfer_megamoe(w: ExpertWeights) -> FlashInferMegaMxfp4:
    """The project's MXFP4 weights as FlashInfer's MegaMoE raw ABI (bytes unchanged, GEMM1 rows [gate; up])."""
    w = _rowmajor_mxfp4(w, "FlashInfer MegaMoE")
    return FlashInferMegaMxfp4(_gate_then_up(w.w1, w.gate_up_layout), _gate_then_up(w.w1_scale, w.gate_up_layout),
                               w.w2.contiguous(), w.w2_scale.contiguous())


def to_triton_kernels(w: ExpertWeights) -> TritonKernelsMxfp4:
    """The project's MXFP4 weights as matmul_ogs' logical operands (transposed views of the same bytes)."""
    w = _rowmajor_mxfp4(w, "triton_kernels")
    w1, s1 = _interleaved(w.w1, w.gate_up_layout), _interleaved(w.w1_scale, w.gate_up_layout)
    return TritonKernelsMxfp4(w1.transpose(-2, -1), s1.transpose(-2, -1), w.w2.transpose(-2, -1),
                              w.w2_scale.transpose(-2, -1))
