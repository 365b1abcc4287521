"""Building and sharing aiter's fused MegaMoE runtimes (MegaMoEV2 on gfx950, MegaMoEGfx1250 on gfx1250).

One runtime serves every MoE layer of a model: its communication arena is sized by geometry, not
weights. The cache key holds everything the runtime fixes at construction -- the dispatch wire
and combine quant included, since they change the arena's layout -- so a layer never reuses a
runtime built for another wire. Weights are per layer and travel with each forward call.

Arguments are passed only when the installed class's signature has them (aiter's MegaMoE API
moved between revisions), and everything aiter would otherwise read from the environment
(MEGA_DISPATCH, MEGA_DISPATCH_WIRE, MEGA_COMBINE_QUANT) is passed explicitly, so the runtime
cannot drift from the knobs MegaMoE validated. Not run on AMD hardware.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import astuple, dataclass
from typing import Any, Callable

from ...knobs import KnobError
from ...platform.facts import AITER_GFX1250_MODULE, AITER_V2_MODULE

logger = logging.getLogger("megamoe")

# MegaMoEV2 binds weights at construction in ROCm/aiter e4048607 and offers no public setter;
# how this adapter gives each layer its own weights without touching private attributes:
BIND_FORWARD = "forward-args"  # forward(..., w1=, w1_scale=, w2=, w2_scale=)
BIND_SETTER = "set_weights"  # public set_weights(w1, w1_scale, w2, w2_scale) before each forward
BIND_PER_LAYER = "per-layer-instance"  # one runtime per layer (memory x layers): logged loudly


@dataclass(frozen=True)
class AiterRuntimeSpec:
    """Everything an aiter MegaMoE runtime fixes at construction (the cache key)."""

    runtime: str
    rank: int
    world_size: int
    model_dim: int
    inter_dim: int
    experts: int
    topk: int
    mtpr: int
    quant: str
    swiglu_limit: float
    dispatch_backend: str
    dispatch_wire: str
    combine_quant: str
    a_operand: str
    layer_id: int | None = None  # set only in BIND_PER_LAYER mode

    def key(self, group: Any) -> tuple:
        return astuple(self) + (id(group),)


_RUNTIMES: dict[tuple, Any] = {}
_CCO: dict[int, Any] = {}


def clear_aiter_runtimes() -> None:
    _RUNTIMES.clear()
    _CCO.clear()


def cached_runtime_keys() -> list[tuple]:
    return list(_RUNTIMES)


def param_names(fn) -> set[str]:
    return {p for p in inspect.signature(fn).parameters if p != "self"}


def runtime_class(name: str, import_module: Callable[[str], Any] = importlib.import_module):
    module = AITER_V2_MODULE if name == "MegaMoEV2" else AITER_GFX1250_MODULE
    return getattr(import_module(module), name)


def v2_binding(cls) -> str:
    if {"w1", "w1_scale", "w2", "w2_scale"} <= param_names(cls.forward):
        return BIND_FORWARD
    if callable(getattr(cls, "set_weights", None)):
        return BIND_SETTER
    return BIND_PER_LAYER


def cco_communicator(group: Any, rank: int, world_size: int, per_rank_vmm: int, dist: Any = None, cco: Any = None):
    """One mori cco Communicator per EP group: rank 0 mints the id, the group broadcasts it."""
    hit = _CCO.get(id(group))
    if hit is not None:
        return hit
    if dist is None:
        import torch.distributed as dist
    cco = cco or importlib.import_module("mori.cco")
    uid = cco.Communicator.get_unique_id() if rank == 0 else None
    box = [uid]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    comm = cco.Communicator.init(world_size, rank, box[0], per_rank_vmm=per_rank_vmm)
    comm.barrier()
    _CCO[id(group)] = comm
    return comm


def cco_per_rank_vmm(world_size: int, hidden: int, mtpr: int) -> int:
    """Symmetric VMM per rank: worst case every rank sends all its bf16 tokens to one peer, twice
    (tokens and combine staging), plus slack -- the sizing ATOM uses for the same arena."""
    window = world_size * mtpr * hidden * 2 * 2 + (1 << 24)
    return 2 * window + (1 << 28)


def build_v2(spec: AiterRuntimeSpec, cls, first_weights, group: Any, init_shmem: Callable[[Any], Any]):
    """MegaMoEV2(rank=, world_size=, model_dim=, inter_dim=, experts=, topk=, quant=, w1=, w1_scale=,
    w2=, w2_scale=, max_tok_per_rank=, swiglu_limit=); runs on mori shmem, so shmem comes first."""
    init_shmem(group)
    kwargs = dict(
        rank=spec.rank, world_size=spec.world_size, model_dim=spec.model_dim, inter_dim=spec.inter_dim,
        experts=spec.experts, topk=spec.topk, quant=spec.quant,
        w1=first_weights.w1, w1_scale=first_weights.w1_scale, w2=first_weights.w2, w2_scale=first_weights.w2_scale,
        max_tok_per_rank=spec.mtpr, swiglu_limit=spec.swiglu_limit,
    )
    accepted = param_names(cls.__init__)
    if "swiglu_limit" not in accepted and spec.swiglu_limit:
        raise KnobError(f"the installed aiter's MegaMoEV2 has no swiglu_limit; this model needs {spec.swiglu_limit}")
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise KnobError(f"aiter MegaMoEV2 rejected the configuration ({exc}); see docs/rocm.md for what it accepts") from exc


def build_gfx1250(spec: AiterRuntimeSpec, cls, group: Any, communicator: Any, aiter_enums: Any):
    """MegaMoEGfx1250(communicator=, rank=, ..., max_tokens_per_rank=, activation=Silu,
    gate_mode=INTERLEAVE, quant_type=per_1x32, swiglu_limit=, dispatch_backend=, [dispatch_wire=],
    [combine_quant=])."""
    accepted = param_names(cls.__init__)
    kwargs = dict(
        communicator=communicator, rank=spec.rank, world_size=spec.world_size, model_dim=spec.model_dim,
        inter_dim=spec.inter_dim, experts=spec.experts, topk=spec.topk, max_tokens_per_rank=spec.mtpr,
        activation=aiter_enums.ActivationType.Silu, gate_mode=aiter_enums.GateMode.INTERLEAVE.value,
        quant_type=aiter_enums.QuantType.per_1x32, swiglu_limit=spec.swiglu_limit,
        dispatch_backend=spec.dispatch_backend,
    )
    for name, value, default in (("dispatch_wire", spec.dispatch_wire, "bf16"), ("combine_quant", spec.combine_quant, "none")):
        if name in accepted:
            kwargs[name] = value
        elif value != default:
            raise KnobError(f"the installed aiter's MegaMoEGfx1250 has no {name} argument; {name}={value!r} cannot be honoured")
    if "dispatch_backend" not in accepted:
        raise KnobError("the installed aiter's MegaMoEGfx1250 has no dispatch_backend argument (needs ROCm/aiter ba59a37 or later)")
    return cls(**kwargs)


def get_runtime(spec: AiterRuntimeSpec, group: Any, factory: Callable[[], Any]) -> tuple[Any, bool]:
    """(runtime, created_now)."""
    key = spec.key(group)
    hit = _RUNTIMES.get(key)
    if hit is not None:
        return hit, False
    runtime = factory()
    _RUNTIMES[key] = runtime
    return runtime, True
