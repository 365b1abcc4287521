"""Backend selection from platform facts and knobs: CUDA -> triton + ipc / symm (every EP rank on one
host with peer access) or nccl; ROCm with aiter and mori -> aiter's fused MegaMoE over mori; CPU ->
torch + gloo.

Why pure: it is the one place that decides what runs, so it must be testable on CPU CI with
injected facts, and ``megamoe info`` must be able to print the same answer with its reasons.
The fused aiter runtime is chosen only when it can honour every knob; when it cannot, the
reason names the knob to change and the unfused path (mori transport + triton/torch experts)
runs instead. Contradictory knobs are errors, never silent reinterpretations.
The ROCm branches restate aiter's / mori's published APIs and have not been run on AMD hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..knobs import KnobError
from .facts import PlatformFacts
from .topology import EpTopology
from .rocm_probes import MoEShape, RocmProbes, V2Runtime
from .rocm_rules import (
    GFX1250_COMBINE_QUANT,
    GFX1250_MAX_EXPERTS_PER_RANK,
    GFX1250_MAX_WORLD_SIZE,
    GFX1250_QUANT_COMBINE_MIN_TOKENS,
    MORI_BLOCKWISE_COMBINE_KERNELS,
    RUNTIME_BY_ARCH,
    V2_MAX_TOPK,
    PlatformError,
    check_experts_divisible,
    check_force_a8w4_agrees,
    check_gfx1250_quant,
    check_gfx1250_wire,
    check_v2_device,
    gfx1250_a_operand,
    gfx1250_dispatch,
    gfx1250_topk_refusal,
    next_power_of_two,
)

MXFP4_SCHEMES = ("a8w4", "a4w4")
# Selection.transport while MEGA_DISPATCH=auto on CUDA waits for the EP group's topology (layer/ep_transport.py
# settles it): an answer of its own, never a transport that runs (plan/forward_choice.py answers "pending" for it)
PENDING_EP_GROUP = "pending"


@dataclass(frozen=True)
class Selection:
    provider: str  # "torch" | "triton" | "aiter"
    transport: str  # "gloo" | "nccl" | "symm" | "ipc" | "mori" | PENDING_EP_GROUP
    dispatch_wire: str
    combine_wire: str
    mtpr: int
    runtime: str | None = None  # aiter class: "MegaMoEV2" | "MegaMoEGfx1250"
    dispatch_kernel: str | None = None  # fused runtime's dispatch: "mori" | "flydsl"
    stage1_fused: bool = False  # MegaMoEGfx1250: aiter's compact plan carries the quantised wire (flydsl dispatch)
    a_operand: str | None = None  # what the expert GEMM consumes, when the platform decides it
    combine_quant: str | None = None  # MegaMoEGfx1250's combine_quant argument
    # MegaMoEV2: the runtimes every layer shares, ascending capacity (aiter's plan, rocm_probes.py); each
    # step runs the smallest that holds the engine's token bound. ``mtpr`` / ``combine_wire``: the largest.
    runtimes: tuple[V2Runtime, ...] = ()
    reasons: tuple[str, ...] = field(default=())

    @property
    def fused(self) -> bool:
        return self.runtime is not None

    @property
    def needs_ep_topology(self) -> bool:
        """MEGA_DISPATCH=auto on CUDA chose without the EP group's topology: the layer completes the choice."""
        return self.transport == PENDING_EP_GROUP

    def describe(self) -> str:
        """One line for the startup log and ``megamoe info``."""
        provider = f"aiter:{self.runtime}" if self.runtime else self.provider
        dispatch = self.dispatch_kernel or self.transport
        parts = [
            f"provider={provider}",
            f"transport={self.transport}",
            f"dispatch={dispatch}",
            f"wire={self.dispatch_wire}",
            f"combine={self.combine_wire}",
            f"mtpr={self.mtpr}",
        ]
        if self.stage1_fused:
            parts.append("stage1_fused=True")
        if self.a_operand:
            parts.append(f"a_operand={self.a_operand}")
        if self.runtimes:
            parts.append("runtimes=" + "+".join(r.describe() for r in self.runtimes))
        return " ".join(parts)


def missing_for_mori(facts: PlatformFacts) -> list[str]:
    missing = []
    if facts.torch_build != "rocm":
        missing.append(f"a ROCm build of torch (this is a {facts.torch_build} build, torch {facts.torch_version})")
    elif facts.device != "rocm":
        missing.append("a visible AMD GPU (torch.cuda.is_available() is False)")
    if not facts.has("mori"):
        missing.append("the amd-mori package (pip install amd-mori==1.2.4; `import mori` fails here)")
    return missing


def _local_provider(facts: PlatformFacts) -> str:
    return "triton" if facts.has("triton") else "torch"


@dataclass(frozen=True)
class RocmAsk:
    """What the ROCm branches need beyond the knobs: the model's shape (aiter's plan builder checks it),
    this process's EP rank and GPU index (MegaMoEV2 allocates on cuda:<ep_rank>), and the probes of
    the installed aiter / mori (rocm_probes.py; tests inject answers)."""

    shape: MoEShape | None = None
    ep_rank: int | None = None
    device_index: int | None = None
    probes: RocmProbes = field(default_factory=RocmProbes)


def select_backends(facts: PlatformFacts, knobs, math, *, ep_size: int | None = None, num_experts: int | None = None,
                    rocm: RocmAsk | None = None) -> Selection:
    """knobs: megamoe_backend.knobs.Knobs (or anything with its fields); math: ExpertMath; ``rocm``: the
    ROCm branches' inputs (without a model shape aiter's plan builder cannot be asked: not fused)."""
    experts_per_rank = check_experts_divisible(num_experts, ep_size)
    if knobs.transport in ("mori", "flydsl"):
        missing = missing_for_mori(facts)
        if missing:
            raise PlatformError(f"MEGA_DISPATCH={knobs.transport} needs " + " and ".join(missing))
    base = dict(dispatch_wire=knobs.dispatch_wire, combine_wire=knobs.combine_wire, mtpr=knobs.max_tokens_per_rank)
    if facts.device == "cpu":
        if knobs.transport in ("symm", "ipc"):
            raise PlatformError(f"MEGA_DISPATCH={knobs.transport} is the device P2P path and needs CUDA GPUs (torch symmetric "
                                "memory / CUDA IPC); this process runs on CPU, where the EP exchange is gloo all_to_all: "
                                "unset MEGA_DISPATCH (or set it to auto), or plan for a GPU (megamoe info --device cuda)")
        return Selection("torch", "gloo", reasons=("cpu: torch reference experts; all_to_all over gloo",), **base)
    if getattr(math, "quant", None) == "fp8_block":  # before any GPU provider is picked for weights it cannot read
        return _select_block_fp8(facts, knobs, ep_size, base)
    if facts.device == "cuda":
        provider = _local_provider(facts)
        if knobs.transport == "auto":
            transport, why = cuda_auto_transport(provider, ep_size, facts.ep_topology)
            reasons = (f"cuda: {provider} experts", f"transport {transport} (MEGA_DISPATCH=auto): {why}")
            return Selection(provider, transport, reasons=reasons, **base)
        # symm / ipc: the device P2P forward (peer arenas, capturable); nccl: the eager torch forward
        if knobs.transport in ("symm", "ipc") and provider != "triton":
            raise PlatformError(f"MEGA_DISPATCH={knobs.transport} is the device P2P forward, which runs the Triton "
                                "experts, and triton is not importable here: install it (pip install "
                                "'megamoe-backend[triton]', Triton >= 3.4), or set MEGA_DISPATCH=nccl (eager) or auto")
        reasons = (f"cuda: {provider} experts", f"transport {knobs.transport} (MEGA_DISPATCH={knobs.transport})")
        return Selection(provider, knobs.transport, reasons=reasons, **base)
    return _select_rocm(facts, knobs, math, ep_size, experts_per_rank, rocm or RocmAsk())


def _select_block_fp8(facts: PlatformFacts, knobs, ep_size: int | None, base: dict) -> Selection:
    """Block-FP8 experts on a GPU: the Triton experts (decoder block_fp8) on CUDA, over the same transports as the
    MXFP4 Triton experts (the device forward at ep_size 1, the device P2P forward on one host: both carry fp8_g128
    rows quantised once by the sender; NCCL otherwise). ROCm is refused, and with it mori / flydsl (ROCm
    transports): the kernels use NVIDIA's e4m3fn FP8 MMA (MI300's FP8 is e4m3fnuz) and were never run there, and
    aiter's fused runtimes do not take block-FP8 weights."""
    if facts.device != "cuda" or not facts.has("triton"):
        why = "triton is not importable here" if facts.device == "cuda" else f"no {facts.device} experts provider computes them"
        raise PlatformError(f"block-FP8 experts (quant=fp8_block) run on CUDA through the Triton experts or on the CPU torch "
                            f"path: {why}; plan for CUDA with Triton >= 3.4 or for the CPU (megamoe info --device cpu)")
    if knobs.transport in ("mori", "flydsl"):
        raise PlatformError(f"MEGA_DISPATCH={knobs.transport} is a ROCm transport and block-FP8 experts (quant=fp8_block) "
                            "run on CUDA only; set MEGA_DISPATCH=auto, symm / ipc (the device P2P forward) or nccl")
    if knobs.transport == "auto":
        transport, why = cuda_auto_transport("triton", ep_size, facts.ep_topology)
    else:
        transport, why = knobs.transport, f"MEGA_DISPATCH={knobs.transport}"
    reasons = ("cuda: triton experts (block_fp8 decoder)", f"transport {transport} (MEGA_DISPATCH={knobs.transport}): {why}")
    return Selection("triton", transport, reasons=reasons, **base)


def cuda_auto_transport(provider: str, ep_size: int | None, topology: EpTopology | None) -> tuple[str, str]:
    """(transport, why) for MEGA_DISPATCH=auto on CUDA; PENDING_EP_GROUP while it needs the EP topology.

    The capturable device P2P forward (ipc / symm) when it can serve: the Triton experts and every
    EP rank able to write every other rank's arena (one host, CUDA peer access); symm where torch
    offers symmetric memory and no two ranks share a GPU, else ipc. Otherwise nccl (eager). Without
    the gathered topology the answer is pending and the layer completes it with its EP group
    (layer/ep_transport.py), which also runs the peer-arena handshake before trusting ipc / symm.
    """
    if ep_size == 1:
        return "nccl", "ep_size 1: nothing is exchanged (the device forward runs on this GPU alone)"
    if provider != "triton":
        return "nccl", "the device P2P forward needs the Triton experts (triton is not importable here)"
    if topology is None:
        return PENDING_EP_GROUP, ("decided at start-up over the EP group: ipc / symm when every EP rank is on one "
                                  "host with CUDA peer access, else nccl")
    if not topology.one_host:
        hosts = ", ".join(h.split("/")[0] for h in topology.hosts)
        return "nccl", (f"{topology.describe()} ({hosts}): the device P2P path needs every EP rank on one host; "
                        "NCCL all_to_all, eager")
    missing = topology.missing_peer_access()
    if missing:
        a, b = missing[0]
        return "nccl", (f"ep_rank {a} cannot write ep_rank {b}'s GPU (no CUDA peer access, or CUDA_VISIBLE_DEVICES hides "
                        f"it; {len(missing)} such pair(s)): NCCL all_to_all, eager")
    if topology.symm_offered and not topology.shares_gpu:
        return "symm", f"{topology.describe()}, every rank its own GPU, peer access: torch symmetric memory"
    why_not_symm = "ranks share a GPU" if topology.shares_gpu else "this torch has no symmetric memory"
    return "ipc", f"{topology.describe()}, peer access: CUDA IPC arenas ({why_not_symm})"


def _select_rocm(facts, knobs, math, ep_size, experts_per_rank, rocm: RocmAsk) -> Selection:
    if knobs.transport in ("symm", "ipc"):
        raise PlatformError(f"MEGA_DISPATCH={knobs.transport} is the CUDA device P2P path; on ROCm use auto, nccl (RCCL) or mori")
    head = f"rocm: {facts.gfx_arch or 'unknown arch'}"
    base = dict(dispatch_wire=knobs.dispatch_wire, combine_wire=knobs.combine_wire, mtpr=knobs.max_tokens_per_rank)
    if knobs.transport == "nccl":
        provider = _local_provider(facts)
        why = "MEGA_DISPATCH=nccl: all_to_all over RCCL; aiter's fused runtimes own their dispatch, so they are not used"
        return Selection(provider, "nccl", reasons=(head, why, f"{provider} experts"), **base)
    fused, why_not = _fused_selection(facts, knobs, math, ep_size, experts_per_rank, head, rocm)
    if fused is not None:
        return fused
    return _unfused_rocm(facts, knobs, head, why_not, ep_size)


def _mori_combine_refusal(facts, knobs, ep_size) -> str | None:
    """Why mori cannot carry this combine wire for this EP group, or None."""
    if knobs.combine_wire == "bf16":
        return None
    if knobs.dispatch_wire != "bf16":
        return (
            f"MEGA_COMBINE_WIRE={knobs.combine_wire} with MEGA_DISPATCH_WIRE={knobs.dispatch_wire}: mori's blockwise "
            "combine quantisation requires bf16 dispatch and combine dtypes (amd-mori 1.2.4 test matrix)"
        )
    topology = facts.ep_topology  # where the ranks run; this process's GPU count says nothing about it
    if ep_size is not None and ep_size > 1 and topology is not None and not topology.one_host:
        return (
            f"MEGA_COMBINE_WIRE={knobs.combine_wire} over {topology.describe()}: mori runs InterNodeV1 / "
            f"InterNodeV1LL across nodes, and its blockwise combine runs on {'/'.join(MORI_BLOCKWISE_COMBINE_KERNELS)} only"
        )
    return None  # without the gathered topology the transport checks its kernel (check_mori_combine_kernel)


def _unfused_rocm(facts, knobs, head, why_not, ep_size) -> Selection:
    provider = _local_provider(facts)
    reasons = [head, f"aiter fused MegaMoE not used: {why_not}"]
    base = dict(dispatch_wire=knobs.dispatch_wire, combine_wire=knobs.combine_wire, mtpr=knobs.max_tokens_per_rank)
    if knobs.transport == "flydsl":
        raise PlatformError(f"MEGA_DISPATCH=flydsl names aiter's fused dispatch, which cannot run here: {why_not}")
    if facts.has("mori"):
        msg = _mori_combine_refusal(facts, knobs, ep_size)
        if msg:
            if knobs.transport == "mori":
                fix = "MEGA_COMBINE_WIRE=bf16" if knobs.dispatch_wire == "bf16" else "MEGA_DISPATCH_WIRE=bf16 or MEGA_COMBINE_WIRE=bf16"
                raise KnobError(f"{msg}; use {fix}")
            reasons.append(msg + "; using RCCL all_to_all instead")
            return Selection(provider, "nccl", reasons=tuple(reasons + [f"{provider} experts"]), **base)
        reasons.append(f"mori EpDispatchCombineOp transport (MEGA_DISPATCH={knobs.transport}); {provider} experts")
        return Selection(provider, "mori", reasons=tuple(reasons), **base)
    reasons.append(f"amd-mori not importable: all_to_all over RCCL; {provider} experts")
    return Selection(provider, "nccl", reasons=tuple(reasons), **base)


def _fused_selection(facts, knobs, math, ep_size, experts_per_rank, head, rocm: RocmAsk):
    """(Selection, None) when aiter's fused runtime can honour every knob, else (None, why not)."""
    runtime = RUNTIME_BY_ARCH.get(facts.gfx_arch or "")
    if runtime is None:
        arch = facts.gfx_arch or "an unknown AMD GPU (no GPU here: plan with --gfx-arch gfx950 | gfx1250)"
        return None, f"no fused aiter MegaMoE runtime for {arch} (MegaMoEV2: gfx950, MegaMoEGfx1250: gfx1250)"
    for pkg, why in (("aiter", "amd-aiter"), ("mori", "amd-mori (aiter's MegaMoE runs on mori shmem / cco)")):
        if not facts.has(pkg):
            return None, f"{why} not importable"
    if math.quant not in MXFP4_SCHEMES:
        return None, f"aiter MegaMoE runtimes take MXFP4 weights (a8w4 / a4w4); this model is {math.quant}"
    if runtime == "MegaMoEV2":
        return _v2_selection(facts, knobs, math, ep_size, experts_per_rank, head, rocm)
    return _gfx1250_selection(facts, knobs, math, ep_size, experts_per_rank, head, rocm)


def _v2_selection(facts, knobs, math, ep_size, experts_per_rank, head, rocm: RocmAsk):
    """MegaMoEV2 as vLLM 0.34's aiter_mega_moe runs it: the runtimes aiter's own plan builder gives
    (rocm_probes.py), each step on the smallest that holds the token bound. Refused (unfused, with the
    reason naming the knob) wherever the installed aiter or the constructor would refuse."""
    caps = facts.aiter_caps
    if not caps.has_v2:
        return None, "the installed aiter has no aiter.ops.flydsl.kernels.mega_moe.MegaMoEV2 (added in ROCm/aiter 97d0c6e)"
    if math.quant == "a4w4" and not caps.v2_accepts_a4w4:
        return None, "the installed aiter's MegaMoEV2 accepts quant='a8w4' only"
    if knobs.dispatch_wire not in ("bf16", math.a_format):
        return None, (
            f"MegaMoEV2 quantises activations to {math.a_format} on the sender (its wire is {math.a_format}); "
            f"MEGA_DISPATCH_WIRE={knobs.dispatch_wire} -> set MEGA_DISPATCH_WIRE={math.a_format} or bf16 to run it"
        )
    shape = rocm.shape
    if shape is None or ep_size is None or experts_per_rank is None:
        return None, "the model shape and EP size are needed to ask aiter's MegaMoEV2 plan builder (planned without them)"
    if shape.topk > V2_MAX_TOPK:
        return None, f"MegaMoEV2 takes top-k in [1, {V2_MAX_TOPK}] (mega_moe_v2.py:57-58); this model routes {shape.topk}"
    device = check_v2_device(rocm.ep_rank, rocm.device_index)
    if device:
        return None, device
    mtpr = next_power_of_two(knobs.max_tokens_per_rank)
    notes = [] if mtpr == knobs.max_tokens_per_rank else [
        f"MEGA_MAX_TOKENS_PER_RANK={knobs.max_tokens_per_rank} rounded up to {mtpr}: aiter MegaMoEV2 needs a power of two"]
    plan = rocm.probes.v2_plan(mtpr, experts_per_rank, shape, ep_size, math.a_format)
    if plan.refusal:
        return None, f"{plan.refusal}; MEGA_MAX_TOKENS_PER_RANK={knobs.max_tokens_per_rank}, EP size {ep_size}"
    runtimes = plan.runtimes
    if knobs.combine_wire != "bf16":  # the knob asks for the fp8 combine: only runtimes aiter runs with it
        runtimes = tuple(r for r in runtimes if r.combine == knobs.combine_wire)
        if not runtimes:
            return None, (
                f"MegaMoEV2 picks its P2P combine wire per runtime ({', '.join(r.describe() for r in plan.runtimes)}: "
                f"fp8_blockwise_1x32 only above max_tok_per_rank 1024); MEGA_COMBINE_WIRE={knobs.combine_wire} -> set "
                "MEGA_COMBINE_WIRE=bf16 or MEGA_MAX_TOKENS_PER_RANK > 1024"
            )
        notes.append(f"MEGA_COMBINE_WIRE={knobs.combine_wire}: every step on {runtimes[-1].describe()} (no bf16 decode runtime)")
    else:
        lossy = [r.describe() for r in runtimes if r.combine != "bf16"]
        if lossy:
            notes.append(f"aiter combines fp8_blockwise_1x32 on {', '.join(lossy)} (above max_tok_per_rank 1024, as upstream); "
                         "the bf16 combine serves the steps a smaller runtime holds")
    if knobs.dispatch_wire == "bf16":
        notes.append(f"MEGA_DISPATCH_WIRE=bf16: MegaMoEV2 sends {math.a_format} rows quantised on the sender (the same "
                     f"1x32 quantisation the receiver applies for {math.quant})")
    reasons = (head, "aiter MegaMoEV2 (fused dispatch + GEMM1 + GEMM2 + combine) on mori shmem", *plan.notes, *notes)
    sel = Selection(
        "aiter", "mori", dispatch_wire=math.a_format, combine_wire=runtimes[-1].combine, mtpr=runtimes[-1].capacity,
        runtime="MegaMoEV2", dispatch_kernel="flydsl", a_operand=math.a_format, runtimes=runtimes, reasons=reasons,
    )
    return sel, None


def _gfx1250_selection(facts, knobs, math, ep_size, experts_per_rank, head, rocm: RocmAsk):
    caps = facts.aiter_caps
    raw = facts.aiter_force_a8w4_raw
    check_force_a8w4_agrees(knobs.aiter_force_a8w4, raw)
    a_operand = gfx1250_a_operand(raw)
    check_gfx1250_wire(knobs.dispatch_wire, a_operand, raw)
    check_gfx1250_quant(math.a_format, math.quant, a_operand, raw)
    if not caps.has_gfx1250:
        return None, "the installed aiter has no MegaMoEGfx1250 (added in ROCm/aiter ba59a37)"
    topk = gfx1250_topk_refusal(rocm.shape.topk) if rocm.shape is not None else None
    if topk:
        return None, topk
    init = set(caps.gfx1250_init or ())
    if knobs.dispatch_wire != "bf16" and "dispatch_wire" not in init:
        return None, f"the installed aiter's MegaMoEGfx1250 has no dispatch_wire argument (bf16 wire only); MEGA_DISPATCH_WIRE={knobs.dispatch_wire}"
    scale_row = knobs.dispatch_wire != "bf16" and rocm.probes.mori_scale_row()
    kernel, stage1_fused, why = gfx1250_dispatch(knobs.transport, knobs.dispatch_wire, scale_row, "stage1_fused" in init)
    if kernel is None:
        return None, why
    combine_quant = GFX1250_COMBINE_QUANT[knobs.combine_wire]
    if combine_quant != "none" and "combine_quant" not in init:
        return None, f"the installed aiter's MegaMoEGfx1250 has no combine_quant argument; MEGA_COMBINE_WIRE={knobs.combine_wire}"
    if ep_size is not None and ep_size > GFX1250_MAX_WORLD_SIZE:
        return None, f"MegaMoEGfx1250 supports world_size <= {GFX1250_MAX_WORLD_SIZE}, EP size is {ep_size}"
    if experts_per_rank is not None and experts_per_rank > GFX1250_MAX_EXPERTS_PER_RANK:
        return None, f"MegaMoEGfx1250 supports <= {GFX1250_MAX_EXPERTS_PER_RANK} experts per rank, got {experts_per_rank}"
    reasons = [head, "aiter MegaMoEGfx1250 (dispatch + grouped GEMM + fused combine) on a mori cco arena", why,
               f"A operand {a_operand} (AITER_FORCE_A8W4={raw!r}); weights viewed as fp4x2, as aiter's grouped "
               "gfx1250 kernel takes A4W4 only for fp4x2 weights"]
    if combine_quant != "none":
        reasons.append(f"combine_quant={combine_quant} built; named on steps of > {GFX1250_QUANT_COMBINE_MIN_TOKENS} tokens per "
                       "rank (bf16 below, as aiter 22f2e2dc and ATOM run it)")
    sel = Selection(
        "aiter", "mori", dispatch_wire=knobs.dispatch_wire, combine_wire=knobs.combine_wire,
        mtpr=knobs.max_tokens_per_rank, runtime="MegaMoEGfx1250", dispatch_kernel=kernel, stage1_fused=stage1_fused,
        a_operand=a_operand, combine_quant=combine_quant, reasons=tuple(reasons),
    )
    return sel, None


def selection_report(knobs, math, facts: PlatformFacts | None = None, *, ep_size: int | None = None,
                     num_experts: int | None = None, rocm: RocmAsk | None = None) -> dict:
    """What ``megamoe info`` prints for the platform: facts, the choice, its one line and its reasons.

    Errors (contradictory knobs, MEGA_DISPATCH=mori without mori) are reported, not raised, so the
    command can show them next to the facts that caused them.
    """
    if facts is None:
        from .facts import detect_facts

        facts = detect_facts()
    out: dict = {"platform": facts.describe()}
    try:
        sel = select_backends(facts, knobs, math, ep_size=ep_size, num_experts=num_experts, rocm=rocm)
    except KnobError as exc:
        out["error"] = str(exc)
        return out
    out.update(
        provider=sel.provider, transport=sel.transport, runtime=sel.runtime, dispatch=sel.dispatch_kernel or sel.transport,
        mtpr=sel.mtpr, line=sel.describe(), reasons=list(sel.reasons), runtimes=[r.describe() for r in sel.runtimes],
    )
    return out
