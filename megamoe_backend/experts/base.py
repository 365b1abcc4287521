"""The experts half of MegaMoE: what every provider (torch reference, Triton, aiter) computes.

Contract: given the rows a rank received (in the A operand's format, or bf16), and a list of
(row, local expert slot, route weight) pairs, return one route-weighted fp32 output row per pair:

    out[p] = w[p] * GEMM2_e( requant_A( SwiGLU_limit( GEMM1_e( A[row[p]] ) ) ) )

GEMM1 uses the gate/up layout of the weights; SwiGLU is silu(min(g, L)) * clamp(u, -L, L) when a
limit L is set (DeepSeek V4 uses 10.0), plain silu(g) * u otherwise. A2 (the SwiGLU output) is
re-quantised to the A format before GEMM2, as upstream MegaMoE does (bf16 scheme: bf16 rounding).
Pairs are independent: a NaN row only poisons its own pairs. The layer asks for these rows already
in its combine wire format (``forward_wire``), so a provider whose last GEMM can write that format
never stores the fp32 rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..formats import GroupFP8Tensor, MXTensor
from ..formats.wire import WireFormat
from ..spec.moe_spec import A_OPERAND
from .weights import ExpertWeights


@dataclass(frozen=True)
class ExpertMath:
    """What the expert GEMMs compute, independent of who computes it."""

    quant: str  # "bf16" | "fp8_block" | "a8w4" | "a4w4"
    swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        if self.quant not in A_OPERAND:
            raise ValueError(f"quant={self.quant!r}; expected one of {tuple(A_OPERAND)}")

    @property
    def a_format(self) -> str | None:
        """Format of the A operand of both GEMMs: MX "fp8" | "fp4", block-FP8 "fp8_g128", or None for bf16."""
        return A_OPERAND[self.quant]


@dataclass(frozen=True)
class ExpertPairs:
    """(received row, local expert slot, route weight) triples, one per routed contribution.

    ``per_row`` = k > 0: the pairs come k to a received row in row order (pair q reads row q // k), as the
    layer's device forwards build them; a provider may then find a pair's row without reading ``row``
    (experts/humming/: its GEMM derives it). 0: only ``row`` says."""

    row: torch.Tensor  # int64 [P]
    slot: torch.Tensor  # int64 [P]
    weight: torch.Tensor  # fp32 [P]
    per_row: int = 0

    def __len__(self) -> int:
        return int(self.row.shape[0])


Activations = torch.Tensor | MXTensor | GroupFP8Tensor


class ExpertsProvider(ABC):
    """Runs the local experts. Implementations differ in speed, never in the math above."""

    name: str = "abstract"

    @abstractmethod
    def forward(self, a: Activations, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath) -> torch.Tensor:
        """Return fp32 [len(pairs), H] route-weighted expert outputs."""

    def forward_wire(
        self, a: Activations, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath, wire: WireFormat
    ) -> torch.Tensor:
        """The same outputs as combine wire rows: uint8 [len(pairs), wire.row_bytes(H)], bit for bit
        ``wire.encode(self.forward(...))`` (except bytes that decode to NaN either way: NaN payload
        bits, and the payload of an fp8 block whose scale is the NaN scale).

        What the layer calls (unless its transport reduces in its combine kernel). This default
        encodes the fp32 rows; a provider whose last GEMM can write the wire row in its epilogue
        overrides it, so the fp32 rows are never written and read back (TritonExperts).
        """
        return wire.encode(self.forward(a, pairs, weights, math))

    @classmethod
    def supports(cls, device: torch.device, math: ExpertMath, weights_fmt: str) -> bool:
        """Capability predicate used by provider selection; overridden by hardware providers."""
        return True

    def weights_become_movable(self, weights: ExpertWeights) -> None:
        """``weights`` (as prepare_weights returned them) may from now on be rewritten in place, expert
        by expert, at any time (an engine's EPLB moving experts between ranks): drop and stop keeping
        any state derived from them. Providers that read the tensors directly keep none."""

    def prepare_weights(self, weights: ExpertWeights, math: ExpertMath | None = None) -> ExpertWeights:
        """Once per layer, before the first forward: weights in the storage this provider reads
        fastest for ``math`` (e.g. MMA-fragment order). The default keeps them as they are."""
        return weights

    def kernel_key(self, weights: ExpertWeights, pairs: int, live, device: torch.device):
        """What decides, on the host, which kernels a forward of ``pairs`` pairs (over ``live`` rows, or
        all of them) launches: a forward whose key its workspace has not seen may compile kernels on
        first launch (layer/device/startup_wait.py gives its peer waits the start-up bound). None: the
        same kernels for every forward (nothing compiled per forward, or nothing to compile)."""
        return None


def swiglu(h: torch.Tensor, layout: str, limit: float | None) -> torch.Tensor:
    """GEMM1 output [..., 2I] -> SwiGLU activation [..., I] in fp32."""
    if layout == "interleaved":
        gate, up = h[..., 0::2], h[..., 1::2]
    else:
        gate, up = h.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up
