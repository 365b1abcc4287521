"""What the installed aiter and mori answer for one model at start-up: aiter's own MegaMoEV2 plan
builder, and whether mori's dispatch carries a per-token scale row.

Why ask them instead of restating their rules: aiter's MegaMoEV2 limits moved within weeks (token
buckets, fixed-slot geometries and their knob, V4-Flash EP sizes, experts per rank), and a rule
copied here runs fused a case the installed aiter refuses -- at the first forward, because the
runtime is built lazily. vLLM 0.34 asks the same builder before it builds anything
(vllm/models/deepseek_v4/amd/mega_moe.py:164-190): ``build_mega_moe_bundle_plan(mtpr,
experts_per_rank=, model_dim=, inter_dim=, world_size=)`` (ROCm/aiter 4d06fb8d
mega_moe/mega_moe_config.py), whose ``fixed_slot_dispatch`` says whether the small runtime takes the
fixed-slot (decode) path and whose entries say each bucket's P2P (combine) wire. Selection
(select.py) calls these probes through ``RocmProbes``; tests inject the fakes at the import.

Not run on AMD hardware: the builder is called exactly as vLLM 0.34 calls it, its answers are
read from the fields vLLM 0.34 reads (``fixed_slot_dispatch``) and the entries' ``config.p2p_quant``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

V2_CONFIG_MODULE = "aiter.ops.flydsl.kernels.mega_moe.mega_moe_config"
MORI_V2_HIP_MODULE = "mori.ops.dispatch_combine_v2.hip_backend"
# aiter's P2P wire name -> ours (mega_moe_config.py MegaMoEConfig.p2p_quant)
P2P_WIRE = {"none": "bf16", "fp8_blockwise_1x32": "fp8_blockwise_1x32"}


@dataclass(frozen=True)
class MoEShape:
    """The model numbers aiter's plan builder and MegaMoEV2's constructor check."""

    hidden: int
    inter: int
    topk: int


@dataclass(frozen=True)
class V2Runtime:
    """One MegaMoEV2 the layers share: its ``max_tok_per_rank``, aiter's dispatch protocol for it and
    the P2P (combine) wire its bundle entries use."""

    capacity: int
    fixed_slot: bool
    combine: str  # "bf16" | "fp8_blockwise_1x32"

    def describe(self) -> str:
        return f"{self.capacity}:{'fixed-slot' if self.fixed_slot else 'compact'}/{self.combine}"


@dataclass(frozen=True)
class V2Plan:
    """aiter's answer: the runtimes (ascending capacity) or why it refuses."""

    runtimes: tuple[V2Runtime, ...] = ()
    refusal: str | None = None
    notes: tuple[str, ...] = ()


def prev_power_of_two(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _plan_call(builder, capacity: int, epr: int, shape: MoEShape, world: int, activation: dict):
    return builder(capacity, experts_per_rank=epr, model_dim=shape.hidden, inter_dim=shape.inter, world_size=world,
                   **activation)


def _builder_params(config: Any) -> set[str]:
    builder = getattr(config, "build_mega_moe_bundle_plan", None)
    return set(inspect.signature(builder).parameters) if callable(builder) else set()


def installed_builder_takes_a_dtype(import_module: Callable[[str], Any] = importlib.import_module) -> bool:
    """Whether the installed aiter plans MegaMoEV2 for fp4 activations (A4W4): its plan builder takes
    ``a_dtype=`` ("fp8" | "fp4", with ``p2p_quant=``) in the A4W4 revision of mega_moe_config.py, and
    4d06fb8d's takes neither (a keyword it lacks is a TypeError). Read from the signature, never from
    source text."""
    try:
        return "a_dtype" in _builder_params(import_module(V2_CONFIG_MODULE))
    except ImportError:
        return False


def _runtime(plan: Any, capacity: int) -> V2Runtime:
    wires = [P2P_WIRE.get(e.config.p2p_quant, e.config.p2p_quant) for e in plan.entries]
    return V2Runtime(capacity, bool(plan.fixed_slot_dispatch), wires[-1] if wires else "bf16")


def installed_v2_plan(mtpr: int, experts_per_rank: int, shape: MoEShape, world_size: int, a_dtype: str = "fp8",
                      import_module: Callable[[str], Any] = importlib.import_module) -> V2Plan:
    """The runtimes vLLM 0.34's aiter_mega_moe would build for this model (mega_moe.py:164-177): one
    at ``mtpr`` and, when ``mtpr`` exceeds it and aiter plans it fixed-slot, one at the largest power
    of two <= aiter's ``FIXED_SLOT_MAX_MTPR`` (255 -> 128; AITER_MEGA_FIXED_SLOT_MAX_MTPR raises it).

    ``a_dtype``: the activations the GEMMs take ("fp8" for a8w4, "fp4" for a4w4), passed as
    ``a_dtype=`` where the builder takes it (the A4W4 revision, whose fp4 plans start the fp8 P2P
    combine at their own threshold: read from the entries, not restated); a builder without it
    plans fp8 only, so fp4 is refused."""
    try:
        config = import_module(V2_CONFIG_MODULE)
    except ImportError as exc:
        return V2Plan(refusal=f"the installed aiter has no {V2_CONFIG_MODULE} ({exc}); vLLM 0.34's integration needs "
                              "ROCm/aiter 4d06fb8d or later (docs/rocm.md)")
    builder = getattr(config, "build_mega_moe_bundle_plan", None)
    params = _builder_params(config)
    if "world_size" not in params:
        return V2Plan(refusal="the installed aiter's build_mega_moe_bundle_plan takes no world_size= (vLLM 0.34 calls it "
                              "so, mega_moe.py:184-190): install ROCm/aiter 4d06fb8d or later (docs/rocm.md)")
    activation = {"a_dtype": a_dtype} if "a_dtype" in params else {}
    if a_dtype != "fp8" and not activation:
        return V2Plan(refusal=f"the installed aiter's build_mega_moe_bundle_plan takes no a_dtype= (ROCm/aiter 4d06fb8d "
                              f"plans fp8 activations only); {a_dtype} activations need its A4W4 revision")
    call = (f"build_mega_moe_bundle_plan({mtpr}, experts_per_rank={experts_per_rank}, model_dim={shape.hidden}, "
            f"inter_dim={shape.inter}, world_size={world_size}{f', a_dtype={a_dtype!r}' if activation else ''})")
    try:
        top = _runtime(_plan_call(builder, mtpr, experts_per_rank, shape, world_size, activation), mtpr)
    except ValueError as exc:
        return V2Plan(refusal=f"aiter's {call} refused: {exc}")
    fixed_max = int(getattr(config, "FIXED_SLOT_MAX_MTPR", 0))
    small = prev_power_of_two(fixed_max) if fixed_max > 0 else 0
    if not small or mtpr <= small:
        return V2Plan(runtimes=(top,), notes=(f"aiter plans one runtime at {top.describe()} ({call})",))
    try:
        decode = _runtime(_plan_call(builder, small, experts_per_rank, shape, world_size, activation), small)
    except ValueError as exc:
        return V2Plan(runtimes=(top,), notes=(f"no decode runtime: aiter refused max_tok_per_rank={small} ({exc})",))
    if not decode.fixed_slot:
        return V2Plan(runtimes=(top,), notes=(
            f"one runtime at {top.describe()}: aiter plans no fixed-slot dispatch for EP {world_size} x "
            f"{experts_per_rank} experts per rank at {small} tokens (its fixed-slot geometries), so decode runs it too",))
    return V2Plan(runtimes=(decode, top), notes=(
        f"two runtimes, as vLLM 0.34: {decode.describe()} for steps of <= {small} tokens per rank (fixed-slot, "
        f"FIXED_SLOT_MAX_MTPR={fixed_max}) and {top.describe()}",))


def installed_mori_scale_row(import_module: Callable[[str], Any] = importlib.import_module) -> bool:
    """Whether the installed mori's EPv2 dispatch forwards a per-token scale row: asked exactly where
    aiter's MegaMoEGfx1250 asks it. Its ``MegaMoEConfig.dispatch_scale_dst_nbytes`` runs ``from
    mori.ops.dispatch_combine_v2.hip_backend import scale_stride_bytes`` and raises "needs a mori whose
    EP dispatch carries a per-token scale row (ROCm/mori#593 or later)" on ImportError. ROCm/mori#593
    adds that module function (``scale_stride_bytes(scale_bytes)``, the row padded to 128 B); it is
    no field of ``EpDispatchCombineConfig``, and 624002c8's HIP backend has none and refuses scale
    rows (hip_backend.py:176-177). A mori whose v2 ops cannot load (OSError: libmori_ops_v2.so
    missing) cannot carry it either."""
    try:
        hip = import_module(MORI_V2_HIP_MODULE)
    except (ImportError, OSError):
        return False
    return callable(getattr(hip, "scale_stride_bytes", None))


@dataclass(frozen=True)
class RocmProbes:
    """The start-up questions selection asks the installed packages (tests inject answers)."""

    v2_plan: Callable[[int, int, MoEShape, int, str], V2Plan] = installed_v2_plan
    mori_scale_row: Callable[[], bool] = installed_mori_scale_row
