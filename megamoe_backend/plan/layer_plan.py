"""LayerPlan: everything resolved for one MegaMoE layer runtime, before any buffer exists.

Why a plan: spec (model), knobs (operator) and the rank's place in the EP group interact —
a quantised wire must match the GEMM's A operand, hidden must split into 1x32 blocks, experts must
split over ranks, the transport must exist on this machine. Resolving them once, into a frozen
object, makes every mismatch a startup error and gives one line to log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..experts.base import ExpertMath
from ..formats import MX_BLOCK, WireFormat, combine_wire, dispatch_wire
from ..formats.block_fp8 import FP8_BLOCK
from ..knobs import KnobError, Knobs
from ..platform import MoEShape, PlatformFacts
from ..spec import MoESpec
from ..spec.moe_spec import WIRE_OF_A_FORMAT
from .placement import ExpertPlacement
from .selection import BackendChoice, manual_choice, select_for_device

# Routing metadata sent with each dispatched row: int32 local slot + fp32 weight per top-k entry.
META_BYTES_PER_TOPK = 8


@dataclass(frozen=True)
class WireBytes:
    """Bytes on the wire. Dispatch: per token per destination rank. Combine: per (token, expert) pair."""

    dispatch_payload: int
    dispatch_scales: int
    dispatch_meta: int
    combine_payload: int
    combine_scales: int

    @property
    def dispatch_row(self) -> int:
        return self.dispatch_payload + self.dispatch_scales

    @property
    def combine_row(self) -> int:
        return self.combine_payload + self.combine_scales


@dataclass(frozen=True)
class LayerPlan:
    spec: MoESpec
    knobs: Knobs
    ep_rank: int
    ep_size: int
    placement: ExpertPlacement
    math: ExpertMath
    dispatch: WireFormat
    combine: WireFormat
    backends: BackendChoice
    notes: tuple[str, ...] = field(default=())
    # what the engine does with CUDA graphs around this layer, once the layer knows (layer/startup.py):
    # "captured" (the engine captures the layer's forward), "eager", or None (no engine said: benchmarks,
    # tests, eager use). The startup line shows it, so an operator sees the layer inside the capture.
    engine_graphs: str | None = None

    @property
    def hidden(self) -> int:
        return self.spec.hidden_size

    @property
    def topk(self) -> int:
        return self.spec.num_experts_per_tok

    @property
    def mtpr(self) -> int:
        """Capacity in tokens per rank: MEGA_MAX_TOKENS_PER_RANK, as the selected runtime rounds it."""
        return self.backends.mtpr

    @property
    def num_local_experts(self) -> int:
        return self.placement.num_local(self.ep_rank)

    def wire_bytes(self) -> WireBytes:
        h = self.hidden
        return WireBytes(
            dispatch_payload=self.dispatch.payload_bytes(h),
            dispatch_scales=self.dispatch.scale_bytes(h),
            dispatch_meta=META_BYTES_PER_TOPK * self.topk,
            combine_payload=self.combine.payload_bytes(h),
            combine_scales=self.combine.scale_bytes(h),
        )

    def layout_key(self) -> tuple:
        """Everything that changes a transport's buffer layout (the transport cache key, less the group)."""
        return (
            self.backends.transport,
            self.ep_size,
            self.hidden,
            self.topk,
            self.mtpr,
            self.dispatch.name,
            self.combine.name,
            self.placement.num_physical,
        )

    def startup_line(self, transport_name: str | None = None, experts: str | None = None) -> str:
        """The one log line per created runtime; ``transport_name`` reports what was actually built, ``experts``
        the experts provider the layer made (the plan's "triton" runs humming-kernels where gemm_choice picks it)."""
        s = self.spec
        limit = "none" if s.swiglu_limit is None else f"{s.swiglu_limit}"
        fused = ""
        if self.backends.runtime:
            fused = f" runtime=aiter:{self.backends.runtime} dispatch={self.backends.dispatch_kernel}"
        return (
            f"[megamoe] Created MegaMoE: ep_rank={self.ep_rank} ep_size={self.ep_size} hidden={s.hidden_size} "
            f"inter={s.moe_intermediate_size} {self.placement.describe()} topk={s.num_experts_per_tok} "
            f"mtpr={self.mtpr} quant={self.math.quant} experts_provider={experts or self.backends.provider} "
            f"transport={transport_name or self.backends.transport} wire={self.dispatch.name} combine={self.combine.name} "
            f"swiglu_limit={limit}{fused}{'' if self.engine_graphs is None else f' graphs={self.engine_graphs}'}"
        )


# what each scheme's experts multiply their weights with, in words (errors name it, not "A operand")
ACTIVATIONS_OF = {"bf16": "bf16 activations", "a8w4": "fp8 activations on MXFP4 weights",
                  "a4w4": "fp4 activations on MXFP4 weights",
                  "fp8_block": "fp8 activations in 1x128 groups (fp32 scales) on block-FP8 weights"}


def check_wire_matches_quant(wire: str, quant: str) -> None:
    """A quantised dispatch wire must carry the activations the experts multiply (fp8 for a8w4, fp4 for
    a4w4): the rows are quantised once, on the sender; bf16 is always legal. The error names the knob,
    what would be legal, and -- for MXFP4 experts on the fp8 wire -- AITER_FORCE_A8W4=1, which runs the
    same MXFP4 weights on fp8 activations and so makes that wire legal."""
    a_format = ExpertMath(quant).a_format
    a_format = WIRE_OF_A_FORMAT.get(a_format, a_format)  # the wire that carries it (fp8_g128 rides "fp8")
    if wire == "bf16" or wire == a_format:
        return
    legal = "bf16" if a_format is None else f"bf16 or {a_format}"
    fix = f"set MEGA_DISPATCH_WIRE={a_format}, bf16, or unset it" if a_format else "unset MEGA_DISPATCH_WIRE or set it to bf16"
    if quant == "a4w4" and wire == "fp8":
        fix += "; or set AITER_FORCE_A8W4=1 to run the MXFP4 experts on fp8 activations (A8W4), which takes the fp8 wire"
    elif quant == "a8w4" and wire == "fp4":
        fix += " (an A4W4 run needs an A4W4 checkpoint, or AITER_FORCE_A8W4=0 where the engine chose A8W4)"
    raise KnobError(
        f"MEGA_DISPATCH_WIRE={wire} does not match the experts: quant={quant} multiplies {ACTIVATIONS_OF.get(quant, quant)}, so "
        f"the dispatch wire may carry {legal} rows only (allowed for this model: {legal}). {fix[0].upper()}{fix[1:]}. "
        "No silent fallback."
    )


def check_block_fp8_shape(spec: MoESpec, quant: str) -> None:
    """Block-FP8 experts need hidden and intermediate sizes in whole 128-blocks (weights 128 x 128, A 1 x 128)."""
    if quant != "fp8_block":
        return
    for key in ("hidden_size", "moe_intermediate_size"):
        if getattr(spec, key) % FP8_BLOCK:
            raise ValueError(f"quant=fp8_block needs {key} % {FP8_BLOCK} == 0 (128x128 weight blocks, 1x128 "
                             f"activation groups), got {key}={getattr(spec, key)}")


def check_ep_position(ep_rank: int, ep_size: int) -> None:
    """The EP group size and this rank's place in it (``megamoe info --ep-size / --ep-rank``, the
    engine's EP group): checked first, so a bad size is named before anything is sized by it."""
    if ep_size < 1:
        raise ValueError(f"ep_size={ep_size}: the EP group needs at least 1 rank (megamoe info --ep-size N, "
                         "N = the GPUs the experts are spread over, e.g. --ep-size 8; in an engine: its EP size)")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} must be in 0..{ep_size - 1} for ep_size={ep_size} "
                         "(megamoe info --ep-rank R with 0 <= R < --ep-size)")


def build_plan(
    spec: MoESpec,
    knobs: Knobs,
    ep_rank: int = 0,
    ep_size: int = 1,
    placement: ExpertPlacement | None = None,
    device_type: str = "cpu",
    quant: str | None = None,
    backends: BackendChoice | tuple[str, str] | None = None,
    facts: PlatformFacts | None = None,
) -> LayerPlan:
    """Resolve spec x knobs x EP position into a LayerPlan, raising on every mismatch.

    ``quant`` overrides the spec's scheme (benchmarks, demo); ``backends`` overrides selection
    (tests, plugins that already know their transport): a Selection or (provider, transport);
    ``facts`` replaces this machine's platform facts (``megamoe info --gfx-arch``).
    """
    check_ep_position(ep_rank, ep_size)
    quant = quant or spec.quant
    math = ExpertMath(quant=quant, swiglu_limit=spec.swiglu_limit)
    check_wire_matches_quant(knobs.dispatch_wire, quant)
    dwire = dispatch_wire(knobs.dispatch_wire, math.a_format)
    cwire = combine_wire(knobs.combine_wire)
    dwire.check_hidden(spec.hidden_size, "MEGA_DISPATCH_WIRE")
    cwire.check_hidden(spec.hidden_size, "MEGA_COMBINE_WIRE")
    check_block_fp8_shape(spec, quant)
    if math.a_format is not None and spec.moe_intermediate_size % MX_BLOCK:
        raise ValueError(
            f"quant={quant} needs moe_intermediate_size % {MX_BLOCK} == 0, got {spec.moe_intermediate_size}"
        )
    placement = placement or ExpertPlacement.linear(spec.n_routed_experts, ep_size)
    if placement.ep_size != ep_size:
        raise ValueError(f"placement is for ep_size={placement.ep_size}, plan for ep_size={ep_size}")
    if isinstance(backends, tuple):
        backends = manual_choice(*backends, knobs)
    shape = MoEShape(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts_per_tok)
    choice = backends or select_for_device(
        knobs, math, device_type, ep_size=ep_size, num_experts=placement.num_physical, shape=shape, ep_rank=ep_rank,
        facts=facts,
    )
    return LayerPlan(
        spec=spec,
        knobs=knobs,
        ep_rank=ep_rank,
        ep_size=ep_size,
        placement=placement,
        math=math,
        dispatch=dwire,
        combine=cwire,
        backends=choice,
    )
