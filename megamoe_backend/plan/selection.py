"""Which experts provider and which transport run, and why.

Selection is data: it takes the device kind and the knobs and returns names plus the reasons, so
`megamoe info` can print them and tests can check every branch without the hardware.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ..experts.base import ExpertMath
from ..knobs import KnobError, Knobs


@dataclass(frozen=True)
class BackendChoice:
    provider: str  # "torch" | "triton" | "aiter"
    transport: str  # "gloo" | "nccl" | "symm" | "mori"
    reasons: tuple[str, ...] = ()


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def select_backends(knobs: Knobs, math: ExpertMath, device_type: str) -> BackendChoice:
    """device_type: "cpu" | "cuda" | "rocm" (torch.version.hip set)."""
    reasons: list[str] = []
    if device_type == "cpu":
        if knobs.transport in ("symm", "mori"):
            need = "CUDA GPUs with NVLink (torch symmetric memory)" if knobs.transport == "symm" else "a ROCm GPU with amd-mori"
            raise KnobError(f"MEGA_DISPATCH={knobs.transport} needs {need}; this process runs on CPU (use auto or nccl)")
        reasons.append("cpu: torch reference experts; torch.distributed all_to_all over gloo")
        return BackendChoice("torch", "gloo", tuple(reasons))
    if device_type == "cuda":
        if knobs.transport == "mori":
            raise KnobError("MEGA_DISPATCH=mori needs a ROCm GPU with amd-mori; this is a CUDA device (use auto, nccl or symm)")
        provider = "triton" if _importable("triton") else "torch"
        reasons.append(f"cuda: {provider} experts" + ("" if provider == "triton" else " (triton not importable)"))
        transport = "symm" if knobs.transport == "symm" else "nccl"
        reasons.append(f"transport {transport} (MEGA_DISPATCH={knobs.transport})")
        return BackendChoice(provider, transport, tuple(reasons))
    if device_type == "rocm":
        from ..platform import rocm_selection  # ROCm-only policy lives with the platform facts

        return rocm_selection(knobs, math)
    raise ValueError(f"device_type={device_type!r}; expected cpu, cuda or rocm")
