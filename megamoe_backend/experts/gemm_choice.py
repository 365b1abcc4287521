"""Who runs the expert GEMMs: the project's Triton kernels or humming-kernels. One rule, facts in, choice out.

Why one function: the layer (registry.make_provider), ``megamoe info`` and the tests ask the same question;
answered in each place they would drift (the forward oracle's lesson, plan/forward_choice.py). Pure: the
facts are plain values, gathered apart (``gemm_facts``), so CPU tests inject every platform.

humming-kernels is what vLLM 0.33 / 0.34 run for MXFP4 MoE experts on Hopper. Its GEMMs on FP8 rows at one
fp32 scale per row compute the project's A8W4 (frag8) numerics; its 128 x 128 block-scaled FP8 GEMMs compute the
block-FP8 scheme (DeepSeek V3 / R1 FP8 checkpoints, A in 1 x 128 groups). It can serve on an sm_90 GPU, for those
two schemes (HUMMING_SCHEMES), with humming-kernels 0.1.19 .. 0.1.x importable with the CUDA headers its NVRTC JIT
compiles against; elsewhere (other GPUs, ROCm, the CPU interpreter, bf16 / A4W4 experts) the Triton experts run.
``auto`` picks humming where it can serve, on the forwards it was measured faster on (AUTO_HUMMING_FORWARDS)
and while its scratch takes at most HUMMING_SCRATCH_SHARE of the GPU (below). ``MEGA_EXPERTS_GEMM=humming``
where humming cannot serve is a start-up KnobError naming what is missing and the fix; never a silent fallback.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..knobs.env import KnobError, check_experts_gemm

HUMMING_DIST = "humming-kernels"
HUMMING_MIN = (0, 1, 19)  # what vLLM 0.34 installs (humming-kernels[cu13]==0.1.19)
HUMMING_BELOW = (0, 2)  # the 0.1 series: a 0.2 may change the API this adapter calls (experts/humming/library.py)
HUMMING_SM = (9, 0)  # Hopper: humming's wgmma W4A8 path; on other GPUs its A8W4 numerics differ (block-scaled MMA)
# FP8 activations on MXFP4 weights, and 1 x 128 FP8 groups on 128 x 128 FP8 blocks; A4W4 needs fp4 MMA (sm_120),
# bf16 is W4A16
HUMMING_SCHEMES = ("a8w4", "fp8_block")
HUMMING_NUMERICS = {"a8w4": "FP8 rows at one scale per row on MXFP4 weights",
                    "fp8_block": "FP8 in 1 x 128 groups on 128 x 128 FP8 weight blocks"}
INSTALL_FIX = "pip install 'megamoe-backend[humming]' (humming-kernels[cu13] >= 0.1.19, < 0.2)"
# Where auto runs humming where it can serve: the forwards it was measured faster on, by ep_size ("ep1": the
# ep_size-1 device forward; "ep": the device P2P forward of an EP rank). One H100, 48 local experts, A8W4, same
# runs for both providers (benchmarks/results/h100_layer_{triton,humming}.json, h100_emulated_ep{8,2}_*.json;
# docs/performance.md "Who runs the expert GEMMs"): ep_size-1 layer 1.01 / 0.98 / 1.03 / 0.89x the Triton one at
# 8 / 128 / 1024 / 8192 tokens; an emulated EP 8 rank 0.99 / 1.01 / 0.99x at 8 / 128 / 1024, an EP 2 rank 0.97x at
# 8192. Prefill gains 3-11 %, decode is even, the 1024-token bucket at ep_size 1 costs 3 %: both forwards listed.
AUTO_HUMMING_FORWARDS: tuple[str, ...] = ("ep1", "ep")
# The same for block-FP8 experts (DeepSeek V3 / R1 FP8). One H100, 32 DeepSeek V3 experts, the experts bench in one
# run (benchmarks/results/h100_block_fp8_r2.json): humming 458 / 551 / 1188 / 7959 µs against the Triton experts'
# 477 / 540 / 1596 / 11003 at 8 / 128 / 1024 / 8192 tokens (1.04 / 0.98 / 1.34 / 1.38x), relL2 to fp32 0.0437-0.0449
# (Triton 0.0436-0.0450). An emulated EP 8 rank (DSV4-Pro shapes, 48 local experts, bound passed), both providers on
# one H100 in one call (h100_emulated_ep8_block_fp8_{humming,triton}.json): humming 784 / 1197 / 1974 µs against
# Triton's 780 / 1158 / 2350 at 8 / 128 / 1024 tokens (1.00 / 1.03 / 0.84x). Under EP humming's rows stay within
# 0.03 relL2 of its ep_size-1 rows, graph replay equal to eager (tests/kernels/test_gpu_block_fp8_ep.py, passed on
# an H100). Prefill takes 16-28 % less time (the EP 8 rank at 1024 tokens; the experts at ep_size 1, 1024 / 8192),
# decode is even to 3 % slower: both forwards listed, as for MXFP4.
AUTO_HUMMING_BLOCK_FP8_FORWARDS: tuple[str, ...] = ("ep1", "ep")
# auto never spends more than this share of the GPU's memory on humming's scratch (its GEMMs hold rows per pair of
# capacity, experts/humming/footprint.py: 7.3 GB a rank at EP 8, MTPR 8192, DSV4-Pro, fp8 wire): that memory is the engine's
# KV cache. MEGA_EXPERTS_GEMM=humming runs it anyway (megamoe info counts it and warns).
HUMMING_SCRATCH_SHARE = 0.05
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
    ep_size: int = 1  # which forward runs the experts: the ep_size-1 device forward, or an EP rank's
    scratch_bytes: int | None = None  # humming's scratch at the layer's capacity (footprint.py); None: not sized
    gpu_bytes: int | None = None  # the GPU's memory; None: unknown (no such GPU in this process)


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
    if f.knob == "auto":
        held_back = _auto_holds_back(f, missing)
        if held_back is not None:
            return GemmChoice("triton", f"the project's Triton GEMMs (MEGA_EXPERTS_GEMM=auto: {held_back})")
    if missing is None and f.capability is None:  # no such GPU in this process: what is installed here says nothing
        return GemmChoice("pending", "decided on the GPU host: humming-kernels on an sm_90 GPU where it is installed "
                          f"({HUMMING_DIST} {_range()}), else "
                          + ("refused (MEGA_EXPERTS_GEMM=humming)" if f.knob == "humming" else "the Triton GEMMs"))
    if missing is None:
        return GemmChoice("humming", f"{HUMMING_DIST} {f.humming_version} on sm_{f.capability[0]}{f.capability[1]}, "
                          f"{f.quant} (MEGA_EXPERTS_GEMM={f.knob}): humming's Hopper GEMMs, {HUMMING_NUMERICS[f.quant]}")
    if f.knob == "humming":
        raise KnobError(f"MEGA_EXPERTS_GEMM=humming cannot be served: {missing[0]}. {missing[1]}")
    return GemmChoice("triton", f"the project's Triton GEMMs (MEGA_EXPERTS_GEMM=auto; humming-kernels not used: {missing[0]})")


def auto_forwards(quant: str) -> tuple[str, ...]:
    """The forwards auto runs humming on for the experts' scheme ``quant`` (measured, above)."""
    return AUTO_HUMMING_BLOCK_FP8_FORWARDS if quant == "fp8_block" else AUTO_HUMMING_FORWARDS


def forward_kind(ep_size: int) -> str:
    """AUTO_HUMMING_FORWARDS' name of the forward a layer of ``ep_size`` runs its experts in."""
    return "ep1" if ep_size == 1 else "ep"


def _auto_holds_back(f: GemmFacts, missing: tuple[str, str] | None) -> str | None:
    """Why auto keeps the Triton GEMMs although humming-kernels may serve, or None where auto runs humming."""
    if missing is not None:
        return f"humming-kernels not used: {missing[0]}"
    kind = forward_kind(f.ep_size)
    if kind not in auto_forwards(f.quant):
        where = "at ep_size 1" if kind == "ep1" else f"on an EP rank (ep_size {f.ep_size})"
        could = (f"{f.humming_version} could serve here" if f.capability is not None else
                 "would serve on an sm_90 GPU where installed")
        return (f"the humming provider was not measured faster {where} (docs/performance.md); humming-kernels {could}, "
                "MEGA_EXPERTS_GEMM=humming runs it")
    if f.scratch_bytes is not None and f.gpu_bytes and f.scratch_bytes > HUMMING_SCRATCH_SHARE * f.gpu_bytes:
        return (f"humming-kernels' scratch would take {f.scratch_bytes / 1e9:.1f} GB, more than "
                f"{HUMMING_SCRATCH_SHARE:.0%} of this GPU's {f.gpu_bytes / 1e9:.0f} GB, at this MEGA_MAX_TOKENS_PER_RANK "
                "x top-k x ep_size; lower MEGA_MAX_TOKENS_PER_RANK, or MEGA_EXPERTS_GEMM=humming runs it anyway")
    return None


def _humming_missing(f: GemmFacts) -> tuple[str, str] | None:
    """(what keeps humming from serving ``f``, the fix), or None where it can (or it is pending on the GPU)."""
    other = "or unset MEGA_EXPERTS_GEMM / set it to triton for the Triton GEMMs"
    if f.device != "cuda" or f.interpreting:
        where = "the Triton interpreter (TRITON_INTERPRET=1)" if f.interpreting else f"device {f.device}"
        return f"it runs on NVIDIA Hopper GPUs (sm_90), this layer is on {where}", f"Run on an H100 / H200, {other}"
    if f.quant not in HUMMING_SCHEMES:
        return (f"it serves A8W4 experts (fp8 activations on MXFP4 weights) and block-FP8 ones, these are {f.quant}",
                f"Serve an MXFP4 checkpoint as A8W4 (MEGA_DISPATCH_WIRE=fp8 or AITER_FORCE_A8W4=1), {other}")
    if f.capability is None:
        return None  # pending: decided where the GPU is
    if tuple(f.capability) != HUMMING_SM:
        return (f"its FP8 paths here are Hopper's (sm_90); this GPU is sm_{f.capability[0]}{f.capability[1]}",
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


def gemm_facts(knob: str, device, quant: str, probe=None, *, ep_size: int = 1,
               scratch_bytes: int | None = None, planned_gpu_bytes: int | None = None) -> GemmFacts:
    """This process's facts for a layer on ``device`` (a torch device, or a kind "cuda" | "rocm" | "cpu" to
    plan for) at ``ep_size``, whose humming scratch would be ``scratch_bytes`` (layer/memory.py sizes it from
    the plan). humming-kernels is imported (``probe``: experts/humming/library.probe) only where it could
    serve and may be picked: an sm_90 CUDA GPU here, A8W4, MEGA_EXPERTS_GEMM=humming (or auto on a forward
    it runs humming on); elsewhere its installed version alone is read. ``planned_gpu_bytes``: the memory of
    the GPU planned for where this process has none (``megamoe info``: --gpu-memory-gb or the reference GPU)."""
    import importlib.metadata
    import os

    import torch

    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda" and torch.version.hip is not None:
        kind = "rocm"
    capability, gpu_bytes = None, planned_gpu_bytes
    if kind == "cuda" and torch.cuda.is_available():
        index = None if isinstance(device, str) else device
        capability = tuple(torch.cuda.get_device_capability(index))
        gpu_bytes = int(torch.cuda.get_device_properties(index).total_memory)
    try:
        version = importlib.metadata.version(HUMMING_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = None
    facts = GemmFacts(check_experts_gemm(knob), kind, quant, capability, os.environ.get("TRITON_INTERPRET") == "1",
                      version, None, ep_size, scratch_bytes, gpu_bytes)
    asked = knob == "humming" or (knob == "auto" and forward_kind(ep_size) in auto_forwards(quant))
    if asked and capability == HUMMING_SM and quant in HUMMING_SCHEMES and humming_version_accepted(version):
        if probe is None:
            from .humming.library import probe
        facts = dataclasses.replace(facts, humming_error=probe(device))
    return facts


__all__ = ["AUTO_HUMMING_BLOCK_FP8_FORWARDS", "AUTO_HUMMING_FORWARDS", "auto_forwards", "HUMMING_SCRATCH_SHARE", "forward_kind", "GEMMS", "GemmChoice", "GemmFacts", "choose_experts_gemm", "gemm_facts", "humming_version_accepted"]
