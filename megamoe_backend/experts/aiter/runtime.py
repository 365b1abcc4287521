"""Building and sharing aiter's fused MegaMoE runtimes (MegaMoEV2 on gfx950, MegaMoEGfx1250 on gfx1250).

Each runtime serves every MoE layer of a model, as in all three upstream integrations (vLLM
DeepseekV4AiterMegaMoEExperts, SGLang mega_moe_aiter.py, ATOM flydsl_mega_experts.py): its buffers
are sized by geometry, not weights, and one MegaMoEV2 takes 0.24-4.6 GiB of mori's symmetric
heap (heap.py), so one per layer exhausts it. MegaMoEV2 comes as the runtimes aiter's plan gives
(``Selection.runtimes``: vLLM 0.34 holds a fixed-slot one for decode and one at the max,
mega_moe.py:164-177), each shared. The cache key holds everything a runtime fixes at
construction -- the dispatch wire and combine quant included, since they change the arena's
layout -- so a layer never reuses a runtime built for another wire. Weights are per layer and
reach the runtime at each forward (as forward arguments, which ROCm/aiter 4d06fb8d checks for
numel and device, or by ``bind_launch_attrs`` where the forward takes none, as vLLM 0.34 does).

Both runtimes are built and run with ``torch.inference_mode(False)`` and ``no_grad`` (as ATOM and
SGLang do): a runtime outlives the engine phase that builds it; built inside inference mode, its
buffers are inference tensors, and its own in-place updates (MegaMoEGfx1250's
``_total_recv.zero_()``, mega_moe.py:628) fail once a forward runs outside inference mode.

Arguments are passed only when the installed class's signature has them (aiter's MegaMoE API
moved between revisions), and everything aiter would otherwise read from the environment
(MEGA_DISPATCH, MEGA_DISPATCH_WIRE, MEGA_COMBINE_QUANT) is passed explicitly, so the runtime
cannot drift from the knobs MegaMoE validated. Not run on AMD hardware.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import inspect
import logging
from dataclasses import astuple, dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from ...knobs import KnobError
from ...platform.facts import AITER_GFX1250_MODULE, AITER_V2_MODULE
from ...transport.mori import broadcast_from_group_root
from .heap import MoriHeap, v2_shmem_bytes

logger = logging.getLogger("megamoe")

# How each layer's weights reach a shared runtime, best first. MegaMoEGfx1250 takes them as forward
# arguments; so does MegaMoEV2 at ROCm/aiter 4d06fb8d (``supports_layer_weights``: forward(..., w1=,
# w1_scale=, w2=, w2_scale=), checked for numel and device). Before that it bound them at construction
# and its launches read four attributes afresh each forward (e4048607 mega_moe_v2.py:237 ``_s1_w1`` /
# ``_s1_w1_scale``, 345 ``w2`` / ``w2_scale``), which vLLM 0.34 still rebinds per layer (mega_moe.py:277-281).
BIND_FORWARD = "forward-args"  # forward(..., w1=, w1_scale=, w2=, w2_scale=)
BIND_ATTRS = "launch-attrs"  # the four attributes MegaMoEV2's launches read, checked then rebound
# attribute -> our weight field; MegaMoEV2 stores w1 / w1_scale as uint8 views (mega_moe_v2.py:76-77)
V2_LAUNCH_ATTRS = {"_s1_w1": "w1", "_s1_w1_scale": "w1_scale", "w2": "w2", "w2_scale": "w2_scale"}


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
    device: str = ""  # the device the runtime allocates on
    fixed_slot: bool = False  # MegaMoEV2: aiter's plan dispatches this capacity fixed-slot (rocm_probes.py)
    stage1_fused: bool = False  # MegaMoEGfx1250: the compact plan (its own arena layout), platform/rocm_rules.gfx1250_dispatch

    def key(self, group: Any) -> tuple:
        return astuple(self) + (id(group),)

    def shmem_bytes(self) -> int:
        """mori symmetric-heap bytes this runtime allocates (MegaMoEV2; MegaMoEGfx1250 uses a cco arena)."""
        if self.runtime != "MegaMoEV2":
            return 0
        return v2_shmem_bytes(self.world_size, self.model_dim, self.experts // self.world_size, self.topk, self.mtpr,
                              self.fixed_slot)


# Documented caches (one entry per runtime shape and EP group): the runtimes, the cco
# communicators, and the heap each planned runtime will take (checked before any is built).
_RUNTIMES: dict[tuple, Any] = {}
_CCO: dict[int, Any] = {}
_PLANNED_SHMEM: dict[tuple, int] = {}


def clear_aiter_runtimes() -> None:
    _RUNTIMES.clear()
    _CCO.clear()
    _PLANNED_SHMEM.clear()


def plan_shmem(specs: list[AiterRuntimeSpec], group: Any, env: Mapping[str, str] | None = None) -> int:
    """Reserve these runtimes' share of mori's heap at start-up; an error now, not in the first forward.

    Counts every distinct runtime planned in this process (a layer's decode and max runtimes; the
    next layer's are the same ones); returns the total. mori's environment (``env``, default
    os.environ) is read only when a runtime uses the heap.
    """
    planned = dict(_PLANNED_SHMEM)
    for spec in specs:
        if spec.shmem_bytes():
            planned[spec.key(group)] = spec.shmem_bytes()
    if planned == _PLANNED_SHMEM:
        return sum(planned.values())
    total = sum(planned.values())
    sizes = ", ".join(f"max_tok_per_rank {s.mtpr}{' fixed-slot' if s.fixed_slot else ''}" for s in specs if s.shmem_bytes())
    what = f"{len(planned)} shared aiter MegaMoEV2 runtime(s) (EP {specs[0].world_size}: {sizes})"
    MoriHeap.from_env(env).check(total, what)
    _PLANNED_SHMEM.update(planned)
    return total


@functools.lru_cache(maxsize=1)
def hip_runtime() -> Any:
    """The HIP runtime library (documented cache: loaded once), or None where there is none (CPU, CUDA)."""
    try:
        return ctypes.CDLL("libamdhip64.so")
    except OSError:
        return None


def clear_hip_last_error(hip: Any = None) -> None:
    """Clear the HIP last error that mori's cco init can leave (hipErrorNotSupported from its
    hipMemCreate probe): the next torch call that checks it would raise it. mori clears it only
    since ROCm/mori#761 (unreleased); vLLM 0.34 does what this does after every cco init
    (all2all.py:1127-1131, ``CudaRTLibrary().cudaGetLastError()``)."""
    hip = hip if hip is not None else hip_runtime()
    if hip is not None:
        hip.hipGetLastError()


@contextlib.contextmanager
def normal_tensors() -> Iterator[None]:
    """Ordinary (non-inference) tensors, no autograd: how the upstream integrations build and call
    the runtimes (ATOM flydsl_mega_experts.py:134,224; SGLang mega_moe_aiter.py)."""
    with torch.inference_mode(False), torch.no_grad():
        yield


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
    return BIND_ATTRS


def bind_launch_attrs(runtime: Any, weights: Any) -> None:
    """Point MegaMoEV2's launch attributes at this layer's weights.

    Refused, not guessed, when the installed class no longer holds those attributes with this
    layer's shapes and dtypes: a renamed attribute would otherwise run every layer on the first
    layer's weights without a word.
    """
    for attr, field_name in V2_LAUNCH_ATTRS.items():
        new = getattr(weights, field_name)
        old = getattr(runtime, attr, None)
        if not isinstance(old, torch.Tensor) or old.shape != new.shape or old.dtype != new.dtype:
            got = None if not isinstance(old, torch.Tensor) else (tuple(old.shape), old.dtype)
            raise KnobError(
                f"the installed aiter's MegaMoEV2 takes no weights as forward arguments, "
                f"and its {attr!r} is {got}, not {field_name} {tuple(new.shape)} {new.dtype} as in ROCm/aiter "
                "e4048607: one runtime cannot serve every layer; install an aiter whose MegaMoEV2 is listed in docs/rocm.md"
            )
    for attr, field_name in V2_LAUNCH_ATTRS.items():
        setattr(runtime, attr, getattr(weights, field_name))


def cco_communicator(group: Any, rank: int, world_size: int, per_rank_vmm: int, dist: Any = None, cco: Any = None,
                     hip: Any = None):
    """One mori cco Communicator per EP group: the group's first rank mints the id and broadcasts it;
    the HIP last error cco init may leave is cleared before anything else runs (clear_hip_last_error)."""
    hit = _CCO.get(id(group))
    if hit is not None:
        return hit
    cco = cco or importlib.import_module("mori.cco")
    uid = broadcast_from_group_root(cco.Communicator.get_unique_id() if rank == 0 else None, group, dist)
    comm = cco.Communicator.init(world_size, rank, uid, per_rank_vmm=per_rank_vmm)
    clear_hip_last_error(hip)
    comm.barrier()
    _CCO[id(group)] = comm
    return comm


def build_v2(spec: AiterRuntimeSpec, cls, first_weights, init_shmem: Callable[[], Any]):
    """MegaMoEV2(rank=, world_size=, model_dim=, inter_dim=, experts=, topk=, quant=, w1=, w1_scale=,
    w2=, w2_scale=, max_tok_per_rank=, swiglu_limit=); runs on mori shmem, so shmem comes first."""
    init_shmem()
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
        with normal_tensors():
            return cls(**kwargs)
    except ValueError as exc:
        raise KnobError(f"aiter MegaMoEV2 rejected the configuration ({exc}); see docs/rocm.md for what it accepts") from exc


def build_gfx1250(spec: AiterRuntimeSpec, cls, communicator: Any, aiter_enums: Any):
    """MegaMoEGfx1250(communicator=, rank=, ..., max_tokens_per_rank=, activation=Silu,
    gate_mode=INTERLEAVE, quant_type=per_1x32, swiglu_limit=, dispatch_backend=, [dispatch_wire=],
    [stage1_fused=], [combine_quant=]). aiter checks the geometry in its constructor (22f2e2dc
    MegaMoEConfig: top-k in [1, 32], hidden a whole number of combine chunks; ``_combine_tile``: "no
    combine reduce tile fits the ... LDS budget"); its ValueError becomes an error naming the model."""
    accepted = param_names(cls.__init__)
    kwargs = dict(
        communicator=communicator, rank=spec.rank, world_size=spec.world_size, model_dim=spec.model_dim,
        inter_dim=spec.inter_dim, experts=spec.experts, topk=spec.topk, max_tokens_per_rank=spec.mtpr,
        activation=aiter_enums.ActivationType.Silu, gate_mode=aiter_enums.GateMode.INTERLEAVE.value,
        quant_type=aiter_enums.QuantType.per_1x32, swiglu_limit=spec.swiglu_limit,
        dispatch_backend=spec.dispatch_backend,
    )
    for name, value, default in (("dispatch_wire", spec.dispatch_wire, "bf16"), ("combine_quant", spec.combine_quant, "none"),
                                 ("stage1_fused", spec.stage1_fused, False)):
        if name in accepted:
            kwargs[name] = value
        elif value != default:
            raise KnobError(f"the installed aiter's MegaMoEGfx1250 has no {name} argument; {name}={value!r} cannot be honoured")
    if "dispatch_backend" not in accepted:
        raise KnobError("the installed aiter's MegaMoEGfx1250 has no dispatch_backend argument (needs ROCm/aiter ba59a37 or later)")
    try:
        with normal_tensors():
            return cls(**kwargs)
    except ValueError as exc:  # its geometry checks (combine chunk, LDS fit of the reduce tile, top-k): named, not raw
        raise KnobError(f"aiter MegaMoEGfx1250 rejected this model's geometry (hidden {spec.model_dim}, top-{spec.topk}, "
                        f"dispatch {spec.dispatch_backend} wire {spec.dispatch_wire}): {exc}; use MEGA_DISPATCH=nccl to run "
                        "it unfused (docs/rocm.md)") from exc


def get_runtime(spec: AiterRuntimeSpec, group: Any, factory: Callable[[], Any]) -> tuple[Any, bool]:
    """(runtime, created_now)."""
    key = spec.key(group)
    hit = _RUNTIMES.get(key)
    if hit is not None:
        return hit, False
    runtime = factory()
    _RUNTIMES[key] = runtime
    return runtime, True
