"""The memory one MegaMoE layer set takes per GPU, from the plan alone (``megamoe info``).

Why: MEGA_MAX_TOKENS_PER_RANK sizes the device forwards' buffers, and at ep_size > 1 the peer arena
grows with ep x MTPR rows: MTPR=100000 at EP 8 asks for some 17 GB per GPU on top of the weights,
which an engine then no longer has for its KV cache. The sizes here are the ones the forwards
allocate -- ``workspace.device_buffers`` / ``p2p_arena_layout`` / ``p2p_buffers``, the functions the
workspaces are built from -- so the figure cannot drift from what runs.

What is counted, per GPU (this EP rank):
  weights    this rank's local experts x the MoE layers, in the format the experts run (MXFP4: e2m1
             bytes + one E8M0 scale per 32; the Triton fp8-fragment storage of A8W4 / A4W4 on CUDA
             adds one fp32 per row; block-FP8: e4m3 bytes + one fp32 scale per 128 x 128 block)
  workspace  the device forward's fixed buffers, one set per layer shape shared by every layer
             (ep_size 1: token rows, pairs, combine rows; symm / ipc: the peer arena + pair tables)
  humming    where humming-kernels runs the expert GEMMs (MEGA_EXPERTS_GEMM, experts/gemm_choice.py):
             its per-pair scratch at capacity (experts/humming/footprint.py), gigabytes at EP 8
Not counted: the Triton experts' scratch (A2 per layout row, sized by the first forward), the
nccl / gloo torch forward's buffers (allocated per forward, sized by the batch), aiter's / mori's
runtimes (ROCm: their own allocations), and everything the engine holds (attention, KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formats import MX_BLOCK
from ..formats.block_fp8 import FP8_BLOCK
from ..plan import LayerPlan
from ..plan.forward_choice import P2P_TRANSPORTS

# the share of one GPU's memory above which `megamoe info` warns that the workspace crowds out the KV cache
WORKSPACE_SHARE_WARN = 0.05
# the GPU `megamoe info` compares with when this machine has none of the planned kind: an H200 (141 GB) for
# CUDA, an MI355X (288 GB) for ROCm -- the GPUs the serving figures are for
REFERENCE_GPU = {"cuda": ("H200", 141 * 10**9), "rocm": ("MI355X", 288 * 10**9), "cpu": ("H200", 141 * 10**9)}


def expert_weight_bytes(hidden: int, inter: int, quant: str, fragments_fp8: bool = False) -> int:
    """Bytes of one expert's w1 [2I, H] and w2 [H, I] as ``experts/weights.py`` documents them."""
    elements = 2 * inter * hidden + hidden * inter
    if quant == "bf16":
        return 2 * elements
    if quant == "fp8_block":  # e4m3 + one fp32 weight_scale_inv per 128 x 128 block (sizes are whole blocks)
        return elements + 4 * (elements // (FP8_BLOCK * FP8_BLOCK))
    total = elements // 2 + elements // MX_BLOCK  # e2m1 pairs + one E8M0 per 32
    if fragments_fp8:
        total += 4 * (2 * inter + hidden)  # w1_row_scale [2I] + w2_row_scale [H], fp32
    return total


@dataclass(frozen=True)
class LayerMemory:
    """One EP rank's share of the MegaMoE layers' memory (bytes), and what it is compared with."""

    weights_per_layer: int
    moe_layers: int
    workspace: int | None  # None: no fixed workspace on this path (said in workspace_kind)
    workspace_kind: str
    arena: int | None  # the peer arena's bytes (part of workspace), symm / ipc only
    gpu_bytes: int
    gpu_name: str
    mtpr: int
    share_warn: float = WORKSPACE_SHARE_WARN
    humming_scratch: int | None = None  # the humming provider's scratch where it runs (else None)

    @property
    def weights(self) -> int:
        return self.weights_per_layer * self.moe_layers

    @property
    def total(self) -> int:
        return self.weights + (self.workspace or 0) + (self.humming_scratch or 0)

    @property
    def fixed(self) -> int | None:
        """What MEGA_MAX_TOKENS_PER_RANK sizes: the workspace and the humming scratch (None: neither is fixed)."""
        if self.workspace is None and self.humming_scratch is None:
            return None
        return (self.workspace or 0) + (self.humming_scratch or 0)

    def warning(self) -> str | None:
        """The warning when the workspace takes more than ``share_warn`` of the GPU (naming the knob), or
        when weights and workspace do not fit in it at all. Where the weights alone do not fit, lowering
        MEGA_MAX_TOKENS_PER_RANK (which sizes the workspace only) cannot help: the line says what can."""
        if self.weights > self.gpu_bytes:
            return (f"[megamoe] warning: the expert weights alone need {gb(self.weights)} per GPU, more than the "
                    f"{self.gpu_name} has ({gb(self.gpu_bytes)}): spread the experts over more GPUs (a larger --ep-size; "
                    "past one host that is MEGA_DISPATCH=nccl, eager) or use GPUs with more memory")
        if self.total > self.gpu_bytes:
            return (f"[megamoe] warning: weights ({gb(self.weights)}) + workspace ({gb(self.fixed or 0)}) need "
                    f"{gb(self.total)} per GPU, more than the {self.gpu_name} has ({gb(self.gpu_bytes)}): spread the "
                    "experts over more GPUs (a larger EP size) or lower MEGA_MAX_TOKENS_PER_RANK")
        if not self.fixed or self.fixed <= self.share_warn * self.gpu_bytes:
            return None
        what = self.workspace_kind + (" and the humming-kernels scratch" if self.humming_scratch else "")
        return (f"[megamoe] warning: the {what} needs {gb(self.fixed)} per GPU at "
                f"MEGA_MAX_TOKENS_PER_RANK={self.mtpr}, more than {self.share_warn:.0%} of the {self.gpu_name} "
                f"({gb(self.gpu_bytes)}): memory the engine no longer has for its KV cache. Lower "
                "MEGA_MAX_TOKENS_PER_RANK to the most tokens one forward brings to a rank (the engine's "
                "--max-num-batched-tokens / --chunked-prefill-size per rank; default 8192)")

    def lines(self) -> list[str]:
        ws = "none fixed" if self.workspace is None else gb(self.workspace)
        out = [f"weights: {gb(self.weights)} ({self.moe_layers} MoE layers x {gb(self.weights_per_layer)} of local experts)",
               f"workspace: {ws} ({self.workspace_kind}, MTPR {self.mtpr})"]
        if self.arena is not None:
            out.append(f"  of which the peer arena: {gb(self.arena)}")
        if self.humming_scratch is not None:
            out.append(f"humming-kernels scratch: {gb(self.humming_scratch)} (its GEMMs' rows per pair of capacity, "
                       f"MTPR {self.mtpr}; where humming-kernels runs the expert GEMMs)")
        out.append(f"total: {gb(self.total)} per GPU of {gb(self.gpu_bytes)} ({self.gpu_name}); not counted: the "
                   "Triton experts' scratch (sized by the first forward) and the engine's own memory")
        return out

    def to_dict(self) -> dict:
        return {"weights_per_layer": self.weights_per_layer, "moe_layers": self.moe_layers, "weights": self.weights,
                "workspace": self.workspace, "workspace_kind": self.workspace_kind, "arena": self.arena,
                "humming_scratch": self.humming_scratch, "total": self.total, "gpu_bytes": self.gpu_bytes, "gpu": self.gpu_name, "mtpr": self.mtpr,
                "share_warn": self.share_warn, "warning": self.warning()}


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def gpu_memory(device: str) -> tuple[str, int]:
    """(name, bytes) of this machine's first GPU when it has one of ``device``'s kind, else the reference GPU."""
    if device in ("cuda", "rocm"):
        import torch

        if torch.cuda.is_available() and (getattr(torch.version, "hip", None) is not None) == (device == "rocm"):
            props = torch.cuda.get_device_properties(0)
            return props.name, int(props.total_memory)
    name, total = REFERENCE_GPU.get(device, REFERENCE_GPU["cuda"])
    return f"{name} (reference: no GPU here)", total


def humming_scratch_of(plan: LayerPlan) -> int:
    """Bytes of the humming provider's scratch for ``plan``'s layer (capacity MTPR x top-k x ep_size pairs; GEMM2
    writes the combine rows in place on the ep_size-1 forward's bf16 combine wire): what ``megamoe info`` counts
    and what gemm_choice weighs against the GPU's memory."""
    from ..experts.humming.footprint import humming_scratch_bytes

    spec = plan.spec
    return humming_scratch_bytes(plan.mtpr * plan.topk * plan.ep_size, plan.mtpr * plan.ep_size, spec.hidden_size,
                                 spec.moe_intermediate_size, bf16_rows_in=plan.dispatch.name == "bf16",
                                 gemm2_in_place=plan.ep_size == 1 and plan.combine.name == "bf16",
                                 block_fp8=plan.math.quant == "fp8_block")


def layer_memory(plan: LayerPlan, device: str, gpu: tuple[str, int] | None = None,
                 transport: str | None = None, experts_gemm: str = "triton") -> LayerMemory:
    """The memory ``plan`` takes on its EP rank's GPU on ``device``; ``transport`` replaces the plan's
    (``megamoe info`` passes what MEGA_DISPATCH=auto picks on one host while the plan still waits for
    the EP group); ``gpu``: (name, bytes) to compare with (default: this machine's, else an H200);
    ``experts_gemm``: gemm_choice's answer ("humming" counts its scratch, and so does "pending": decided on the
    GPU host, where humming may run; the figure then says what it would take)."""
    from .device.workspace import buffers_bytes, device_buffers, p2p_arena_layout, p2p_buffers

    spec, b = plan.spec, plan.backends
    transport = transport or b.transport
    # the Triton provider keeps MXFP4 weights of MX-activation experts as fp8 fragments on CUDA (prepare_weights)
    provider_frag8 = device == "cuda" and b.provider == "triton" and plan.math.a_format is not None
    per_layer = plan.num_local_experts * expert_weight_bytes(spec.hidden_size, spec.moe_intermediate_size,
                                                             plan.math.quant, provider_frag8)
    arena = None
    if device == "cpu" or b.provider == "torch":
        workspace, kind = None, "torch forward: buffers allocated per forward"
    elif b.fused or transport == "mori":
        workspace, kind = None, f"aiter / mori runtime ({b.runtime or transport}): its own allocations, not estimated here"
    elif plan.ep_size == 1:
        workspace, kind = buffers_bytes(device_buffers(plan)), "device workspace (ep_size 1)"
    elif transport in P2P_TRANSPORTS:
        arena = p2p_arena_layout(plan).total
        workspace, kind = arena + buffers_bytes(p2p_buffers(plan)), f"device P2P workspace ({transport} peer arena)"
    else:
        workspace, kind = None, f"{transport} torch forward: buffers allocated per forward (eager)"
    humming = None
    if experts_gemm in ("humming", "pending") and b.provider == "triton" and device == "cuda":
        humming = humming_scratch_of(plan)
    name, total = gpu or gpu_memory(device)
    return LayerMemory(per_layer, spec.num_moe_layers, workspace, kind, arena, total, name, plan.mtpr,
                       humming_scratch=humming)


__all__ = ["REFERENCE_GPU", "WORKSPACE_SHARE_WARN", "LayerMemory", "expert_weight_bytes", "gpu_memory", "humming_scratch_of",
           "layer_memory"]
