"""Expert providers: the math (base), the torch reference (CPU), and hardware providers."""

from .base import A_OPERAND, ExpertMath, ExpertPairs, ExpertsProvider, swiglu
from .reference import TorchReferenceExperts, activations_in_a_format
from .weights import (
    ExpertWeights,
    deinterleave_gate_up,
    interleave_gate_up,
    quantize_expert_weights,
)

__all__ = [
    "A_OPERAND",
    "ExpertMath",
    "ExpertPairs",
    "ExpertWeights",
    "ExpertsProvider",
    "TorchReferenceExperts",
    "activations_in_a_format",
    "deinterleave_gate_up",
    "interleave_gate_up",
    "quantize_expert_weights",
    "swiglu",
]
