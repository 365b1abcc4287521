"""Who runs the expert GEMMs: the project's Triton kernels or humming-kernels. One rule, facts in, choice out.

Why one function: the layer (registry.make_provider), ``megamoe info`` and the tests ask the same question;
answered in each place they would drift (the forward oracle's lesson, plan/forward_choice.py). Pure: the
facts are plain values, gathered apart (``gemm_facts``), so CPU tests inject every platform.

humming-kernels is what vLLM 0.33 / 0.34 run for MXFP4 MoE experts on Hopper. Its GEMMs on FP8 rows at one
fp32 scale per row compute the project's A8W4 (frag8) numerics and were measured faster than the Triton
experts at prefill (issue 58: 1.41x at 48 experts x 8192 tokens on an H100, about equal at 8 tokens). It can
serve on an sm_90 GPU, for the A8W4 scheme, with humming-kernels 0.1.19 .. 0.1.x importable with the CUDA
headers its NVRTC JIT compiles against; elsewhere (other GPUs, ROCm, the CPU interpreter, bf16 / A4W4
experts) the Triton experts run. ``auto`` picks humming where it can serve once AUTO_PICKS_HUMMING says the
provider was measured faster (below). ``MEGA_EXPERTS_GEMM=humming`` where humming cannot serve is a start-up
KnobError naming what is missing and the fix; never a silent fallback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..knobs.env import KnobError, check_experts_gemm

HUMMING_DIST = "humming-kernels"
HUMMING_MIN = (0, 1, 19)  # what vLLM 0.34 installs (humming-kernels[cu13]==0.1.19)
HUMMING_BELOW = (0, 2)  # the 0.1 series: a 0.2 may change the API this adapter calls (experts/humming/library.py)
HUMMING_SM = (9, 0)  # Hopper: humming's wgmma W4A8 path; on other GPUs its A8W4 numerics differ (block-scaled MMA)
HUMMING_SCHEMES = ("a8w4",)  # FP8 activations on MXFP4 weights; A4W4 needs fp4 MMA (sm_120), bf16 is W4A16
INSTALL_FIX = "pip install 'megamoe-backend[humming]' (humming-kernels[cu13] >= 0.1.19, < 0.2)"
# Whether auto runs humming where it can serve. Its GEMMs were measured faster than the Triton experts at prefill
# (issue 58, H100) and the provider matched the Triton one on an H100 (tests/experts_humming/test_gpu_humming.py,
# 2026-12-07), but the provider's whole forward (its SwiGLU pass over bf16 gate/up rows, its first-use compile of
# 131 kernels, ~21 s) was not yet timed beside Triton: auto keeps Triton until `megamoe bench experts --humming`
# shows the provider faster on the card; then this flips, and every answer below follows.
AUTO_PICKS_HUMMING = False
GEMMS = ("triton", "humming", "pending")


def humming_version_accepted(version: str | None) -> bool:
    """0.1.19 <= ``version`` < 0.2 (pre-releases, dev and local builds of those releases included)."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    if m is None:
        return False
    release = tuple(int(x or 0) for x in m.groups())
    return HUMMING_MIN <= release and release[:2] < HUMMING_BELOW


@dataclass(frozen=True)
class GemmFacts:
    """What decides the GEMMs. ``capability``: the layer's GPU's (major, minor), None where this process
    has no such GPU (``megamoe info --device cuda`` on a CPU box): then the answer is "pending".
    ``humming_error``: why humming-kernels cannot run here although installed (its import failed, NVRTC's
    CUDA headers are missing), None when it imported and found them, or was not probed."""

    knob: str  # MEGA_EXPERTS_GEMM: "auto" | "triton" | "humming"
    device: str  # "cuda" | "rocm" | "cpu"
    quant: str  # the experts' scheme: "a8w4" | "a4w4" | "bf16"
    capability: tuple[int, int] | None = None
    interpreting: bool = False  # TRITON_INTERPRET=1: the kernels run on the CPU interpreter
    humming_version: str | None = None  # the installed distribution's version, None: not installed
    humming_error: str | None = None


@dataclass(frozen=True)
class GemmChoice:
    """``gemm``: "triton" | "humming" | "pending" (decided on the GPU host, where the facts are); ``why``."""

    gemm: str
    why: str


def choose_experts_gemm(f: GemmFacts) -> GemmChoice:
    """The GEMMs for ``f``; KnobError (naming the knob, what is missing, the fix) where MEGA_EXPERTS_GEMM=humming
    cannot be served."""
    check_experts_gemm(f.knob)
    if f.knob == "triton":
        return GemmChoice("triton", "MEGA_EXPERTS_GEMM=triton: the project's Triton GEMMs")
    missing = _humming_missing(f)
    if f.knob == "auto" and not AUTO_PICKS_HUMMING:
        if missing is not None:
            could = f"could not serve here anyway: {missing[0]}"
        elif f.capability is None:
            could = "would serve on an sm_90 GPU where installed; MEGA_EXPERTS_GEMM=humming runs it"
        else:
            could = f"{f.humming_version} could serve here; MEGA_EXPERTS_GEMM=humming runs it"
        return GemmChoice("triton", "the project's Triton GEMMs (MEGA_EXPERTS_GEMM=auto keeps them until the humming "
                          f"provider is measured faster: bench experts --humming; humming-kernels {could})")
    if missing is None and f.capability is None:  # no such GPU in this process: what is installed here says nothing
        return GemmChoice("pending", "decided on the GPU host: humming-kernels on an sm_90 GPU where it is installed "
                          f"({HUMMING_DIST} {_range()}), else "
                          + ("refused (MEGA_EXPERTS_GEMM=humming)" if f.knob == "humming" else "the Triton GEMMs"))
    if missing is None:
        return GemmChoice("humming", f"{HUMMING_DIST} {f.humming_version} on sm_{f.capability[0]}{f.capability[1]}, "
                          f"{f.quant.upper()} (MEGA_EXPERTS_GEMM={f.knob}): the GEMMs vLLM runs on Hopper, FP8 rows at "
                          "one scale per row")
    if f.knob == "humming":
        raise KnobError(f"MEGA_EXPERTS_GEMM=humming cannot be served: {missing[0]}. {missing[1]}")
    return GemmChoice("triton", f"the project's Triton GEMMs (MEGA_EXPERTS_GEMM=auto; humming-kernels not used: {missing[0]})")


def _humming_missing(f: GemmFacts) -> tuple[str, str] | None:
    """(what keeps humming from serving ``f``, the fix), or None where it can (or it is pending on the GPU)."""
    other = "or unset MEGA_EXPERTS_GEMM / set it to triton for the Triton GEMMs"
    if f.device != "cuda" or f.interpreting:
        where = "the Triton interpreter (TRITON_INTERPRET=1)" if f.interpreting else f"device {f.device}"
        return f"it runs on NVIDIA Hopper GPUs (sm_90), this layer is on {where}", f"Run on an H100 / H200, {other}"
    if f.quant not in HUMMING_SCHEMES:
        return (f"it serves A8W4 experts (fp8 activations on MXFP4 weights), these are {f.quant}",
                f"Serve an MXFP4 checkpoint as A8W4 (MEGA_DISPATCH_WIRE=fp8 or AITER_FORCE_A8W4=1), {other}")
    if f.capability is None:
        return None  # pending: decided where the GPU is
    if tuple(f.capability) != HUMMING_SM:
        return (f"its A8W4 path here is Hopper's (sm_90); this GPU is sm_{f.capability[0]}{f.capability[1]}",
                f"Run on an H100 / H200, {other}")
    if f.humming_version is None:
        return f"{HUMMING_DIST} is not installed", f"Install it: {INSTALL_FIX}, {other}"
    if not humming_version_accepted(f.humming_version):
        return (f"{HUMMING_DIST} {f.humming_version} is outside the accepted {_range()}",
                f"Install an accepted one: {INSTALL_FIX}, {other}")
    if f.humming_error is not None:
        return f"{HUMMING_DIST} {f.humming_version} cannot run here: {f.humming_error}", f"Fix that, {other}"
    return None


def _range() -> str:
    lo = ".".join(map(str, HUMMING_MIN))
    hi = ".".join(map(str, HUMMING_BELOW))
    return f">= {lo}, < {hi}"


def gemm_facts(knob: str, device, quant: str, probe=None) -> GemmFacts:
    """This process's facts for a layer on ``device`` (a torch device, or a kind "cuda" | "rocm" | "cpu" to
    plan for). humming-kernels is imported (``probe``: experts/humming/library.probe) only where it could
    serve and may be picked: an sm_90 CUDA GPU here, A8W4, MEGA_EXPERTS_GEMM=humming (or auto where it picks
    humming); elsewhere its installed version alone is read."""
    import importlib.metadata
    import os

    import torch

    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda" and torch.version.hip is not None:
        kind = "rocm"
    capability = None
    if kind == "cuda" and torch.cuda.is_available():
        capability = tuple(torch.cuda.get_device_capability(None if isinstance(device, str) else device))
    try:
        version = importlib.metadata.version(HUMMING_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = None
    facts = GemmFacts(check_experts_gemm(knob), kind, quant, capability, os.environ.get("TRITON_INTERPRET") == "1",
                      version)
    asked = knob == "humming" or (knob == "auto" and AUTO_PICKS_HUMMING)
    if asked and capability == HUMMING_SM and quant in HUMMING_SCHEMES and humming_version_accepted(version):
        if probe is None:
            from .humming.library import probe
        facts = GemmFacts(facts.knob, kind, quant, capability, facts.interpreting, version, probe(device))
    return facts


__all__ = ["AUTO_PICKS_HUMMING", "GEMMS", "GemmChoice", "GemmFacts", "choose_experts_gemm", "gemm_facts", "humming_version_accepted"]
