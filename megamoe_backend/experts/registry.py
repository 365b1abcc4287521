"""Experts providers by name, imported lazily so CPU installs never import GPU stacks."""

from __future__ import annotations

import importlib

from ..knobs import KnobError, Knobs
from .base import ExpertsProvider
from .gemm_choice import GemmChoice, choose_experts_gemm, gemm_facts

# name -> "module:Class"; hardware providers live in their own modules. aiter is not here: its
# MegaMoE runtimes are fused (they own dispatch and combine too), so the layer drives them directly.
# "triton" is the plan's name for the sync-free GPU experts; who runs their GEMMs (the Triton kernels or
# humming-kernels) is gemm_choice's answer, so make_provider("triton", ...) may return HummingExperts.
PROVIDERS = {
    "torch": "megamoe_backend.experts.reference:TorchReferenceExperts",
    "triton": "megamoe_backend.experts.triton:TritonExperts",
    "humming": "megamoe_backend.experts.humming:HummingExperts",
}


def make_provider(name: str, capacity: int | None = None, knobs: Knobs | None = None, device=None,
                  quant: str | None = None, *, ep_size: int = 1, humming_scratch: int | None = None) -> ExpertsProvider:
    """``capacity``: most (row, expert) pairs a forward may carry (MTPR x top-k x ep_size); the GPU
    providers size their static, CUDA-graph-capturable layout by it and refuse more.
    ``knobs``: the operator's choices (the layer passes its plan's), so the environment is read once, by
    Knobs.from_env; None: the defaults. For "triton", MEGA_EXPERTS_GEMM and the facts of ``device`` (the
    layer's; None: "cpu") and ``quant`` (the experts' scheme; None: unknown, which humming does not serve)
    decide whether humming-kernels runs the GEMMs (gemm_choice), with ``ep_size`` (which forward runs them) and
    ``humming_scratch`` (its scratch at ``capacity``: layer/memory.humming_scratch_of)."""
    try:
        target = PROVIDERS[name]
    except KeyError:
        raise ValueError(f"unknown experts provider {name!r}; available: {', '.join(PROVIDERS)}") from None
    knobs = knobs or Knobs()
    if name == "triton":  # KnobError where MEGA_EXPERTS_GEMM=humming cannot be served (no silent fallback)
        choice = choose_experts_gemm(gemm_facts(knobs.experts_gemm, device if device is not None else "cpu", quant or "",
                                                ep_size=ep_size, scratch_bytes=humming_scratch))
        if choice.gemm == "humming":
            name, target = "humming", PROVIDERS["humming"]
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if name == "triton":
        return cls(capacity=capacity, gemm=knobs.experts_gemm)
    if name == "humming":
        return cls(capacity=capacity)
    return cls()


def experts_gemm_choice(knob: str, device: str, quant: str, ep_size: int = 1,
                        humming_scratch: int | None = None, gpu_bytes: int | None = None) -> GemmChoice:
    """gemm_choice's answer for a plan on a ``device`` kind, with a refusal of MEGA_EXPERTS_GEMM=humming as an
    answer ("refused") instead of an error: what ``megamoe info`` prints."""
    try:
        return choose_experts_gemm(gemm_facts(knob, device, quant, ep_size=ep_size, scratch_bytes=humming_scratch,
                                              planned_gpu_bytes=gpu_bytes))
    except KnobError as exc:
        return GemmChoice("refused", str(exc))


def describe_experts_gemm(choice: str, provider: str, device: str = "cpu", quant: str = "a8w4") -> str:
    """What ``megamoe info`` says runs the expert GEMMs for MEGA_EXPERTS_GEMM=``choice``."""
    if provider != "triton":
        return f"{provider} provider (MEGA_EXPERTS_GEMM applies to the GPU experts' GEMMs)"
    answer = experts_gemm_choice(choice, device, quant)
    name = {"triton": "Triton", "humming": "humming-kernels", "pending": "decided on the GPU host",
            "refused": "refused at start-up"}[answer.gemm]
    return f"{name} (MEGA_EXPERTS_GEMM={choice}): {answer.why}"
