"""AiterFusedMoE: one MoE layer run end to end by aiter's fused MegaMoE runtime.

    x [T, H] bf16, top-k -> aiter runtime (dispatch over mori -> GEMM1 + SwiGLU -> GEMM2 ->
    combine) -> [T, H] bf16, owned by the caller

The runtime owns dispatch and combine, so this object replaces the transport + experts pair of
the unfused layer (``fused = True``); it is what ``provider == "aiter"`` means. One runtime per
shape serves every layer (runtime.py); each layer's weights are prepared once with aiter's own
shuffles and bound to the runtime at every forward. Three upstream facts shape the forward:
- the runtime is an EP collective, and MegaMoEV2 refuses zero tokens (mega_moe_config.py:91), so
  an idle rank sends one zero-weight token, as SGLang's integration does, and returns no rows;
- its result is a view of a buffer the runtime rewrites at its next forward -- any layer's, the
  runtime being shared (mega_moe_v2.py:271-278, mega_moe_gfx1250/mega_moe.py:745-750) -- so it is
  copied out (into ``out`` when given) before the next layer can run;
- the heap it needs is checked at construction, before anything is allocated (heap.py).
Not run on AMD hardware.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Mapping

import torch

from ...knobs import KnobError
from ...platform.rocm_rules import check_gfx1250_shapes
from ...platform.select import Selection, select_backends
from ..weights import ExpertWeights
from .routing import rank_major_ids
from .runtime import (
    BIND_ATTRS,
    BIND_FORWARD,
    BIND_SETTER,
    AiterRuntimeSpec,
    bind_launch_attrs,
    build_gfx1250,
    build_v2,
    cco_communicator,
    cco_per_rank_vmm,
    get_runtime,
    normal_tensors,
    param_names,
    plan_shmem,
    runtime_class,
    v2_binding,
)
from .weights import PREPARERS, AiterLayerWeights

logger = logging.getLogger("megamoe")


class _AiterEnums:
    """ActivationType / QuantType from ``aiter``, GateMode from aiter.ops.flydsl.moe_common."""

    def __init__(self, import_module: Callable[[str], Any]) -> None:
        aiter = import_module("aiter")
        self.ActivationType = aiter.ActivationType
        self.QuantType = aiter.QuantType
        self.GateMode = import_module("aiter.ops.flydsl.moe_common").GateMode


class _IdleToken:
    """The one zero-weight token an idle rank sends (to rank 0's first expert), made once per device."""

    def __init__(self) -> None:
        self._by_device: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, hidden: int, topk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._by_device:
            self._by_device[key] = (
                torch.zeros(1, hidden, dtype=torch.bfloat16, device=device),
                torch.zeros(1, topk, dtype=torch.int32, device=device),
                torch.zeros(1, topk, dtype=torch.float32, device=device),
            )
        return self._by_device[key]


class AiterFusedMoE:
    name = "aiter"
    fused = True

    def __init__(
        self,
        plan: Any,
        group: Any = None,
        device: torch.device | str | None = None,
        *,
        selection: Selection | None = None,
        facts: Any = None,
        layer_id: int = 0,
        import_module: Callable[[str], Any] = importlib.import_module,
        dist: Any = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if selection is None:
            if facts is None:
                from ...platform.facts import detect_facts

                facts = detect_facts()
            selection = select_backends(
                facts, plan.knobs, plan.math, ep_size=plan.ep_size, num_experts=plan.placement.num_physical
            )
        if not selection.fused:
            raise KnobError(f"aiter's fused MegaMoE cannot run this plan: {'; '.join(selection.reasons)}")
        counts = {plan.placement.num_local(r) for r in range(plan.ep_size)}
        if len(counts) != 1:
            raise KnobError(f"aiter MegaMoE needs the same expert count on every rank; placement has {sorted(counts)}")
        if selection.runtime == "MegaMoEGfx1250":
            check_gfx1250_shapes(plan.hidden, plan.spec.moe_intermediate_size)
        self.plan, self.group, self.selection = plan, group, selection
        self.device = torch.device(device) if device is not None else None
        self.experts_per_rank = counts.pop()
        self.layer_id = layer_id
        self._import = import_module
        self._cls = runtime_class(selection.runtime, import_module)
        self._owner, self._slot = plan.placement.tables("cpu")
        self._dist = dist
        self.binding = BIND_FORWARD if selection.runtime == "MegaMoEGfx1250" else v2_binding(self._cls)
        self._runtime = None
        self._forward_params = param_names(self._cls.forward)
        self._idle = _IdleToken()
        self.shmem_bytes = plan_shmem(self.spec(), group, env)

    def spec(self) -> AiterRuntimeSpec:
        p, s = self.plan, self.selection
        return AiterRuntimeSpec(
            runtime=s.runtime, rank=p.ep_rank, world_size=p.ep_size, model_dim=p.hidden,
            inter_dim=p.spec.moe_intermediate_size, experts=p.placement.num_physical, topk=p.topk, mtpr=s.mtpr,
            quant=p.math.quant, swiglu_limit=float(p.math.swiglu_limit or 0.0),
            dispatch_backend=s.dispatch_kernel, dispatch_wire=s.dispatch_wire,
            combine_quant=s.combine_quant or "none", a_operand=s.a_operand or "",
            device=str(self.device) if self.device is not None else "",
        )

    def prepare_weights(self, weights: ExpertWeights) -> AiterLayerWeights:
        if weights.num_experts != self.experts_per_rank:
            raise ValueError(f"weights hold {weights.num_experts} experts, this rank owns {self.experts_per_rank}")
        shuffle = self._import("aiter.ops.shuffle")
        return PREPARERS[self.selection.runtime](weights, shuffle)

    def _init_shmem(self) -> None:
        from ...transport.mori import init_mori_shmem

        init_mori_shmem(self.group, self.plan.ep_rank, self.plan.ep_size, shmem=self._import("mori.shmem"), dist=self._dist)

    def _build(self, layer_weights: AiterLayerWeights):
        spec = self.spec()
        if spec.runtime == "MegaMoEV2":
            return build_v2(spec, self._cls, layer_weights, self._init_shmem)
        vmm = cco_per_rank_vmm(spec.world_size, spec.model_dim, spec.mtpr)
        comm = cco_communicator(self.group, spec.rank, spec.world_size, vmm, dist=self._dist, cco=self._import("mori.cco"))
        return build_gfx1250(spec, self._cls, comm, _AiterEnums(self._import))

    def runtime(self, layer_weights: AiterLayerWeights):
        if self._runtime is None:
            self._runtime, created = get_runtime(self.spec(), self.group, lambda: self._build(layer_weights))
            if created:
                logger.info(self.startup_line())
        return self._runtime

    def startup_line(self) -> str:
        s = self.selection
        extra = f" combine_quant={s.combine_quant}" if s.combine_quant else ""
        heap = f" shmem={self.shmem_bytes / (1 << 30):.2f}GiB" if self.shmem_bytes else ""
        return (
            f"[megamoe] aiter {s.runtime}: ep_rank={self.plan.ep_rank} ep_size={self.plan.ep_size} "
            f"dispatch={s.dispatch_kernel} transport={s.transport} wire={s.dispatch_wire} combine={s.combine_wire}{extra} "
            f"a_operand={s.a_operand} mtpr={s.mtpr} weights={self.binding} shared by all layers{heap} "
            "(not validated on AMD hardware)"
        )

    def _call_runtime(self, runtime, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, lw: AiterLayerWeights):
        w = dict(w1=lw.w1, w1_scale=lw.w1_scale, w2=lw.w2, w2_scale=lw.w2_scale)
        if self.selection.runtime == "MegaMoEGfx1250":
            if "combine_quant" in self._forward_params:
                w["combine_quant"] = self.selection.combine_quant or "none"
            return runtime.forward(x, weights, ids, **w)
        if self.binding == BIND_FORWARD:
            return runtime.forward(x, weights, ids, **w)
        if self.binding == BIND_SETTER:
            runtime.set_weights(w["w1"], w["w1_scale"], w["w2"], w["w2_scale"])
        elif self.binding == BIND_ATTRS:
            bind_launch_attrs(runtime, lw)
        return runtime.forward(x, weights, ids)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer_weights: AiterLayerWeights,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """-> bf16 [T, H] the caller owns: ``out`` when given (bf16 [T, H]), else a new tensor."""
        if layer_weights.runtime != self.selection.runtime:
            raise ValueError(f"weights were prepared for {layer_weights.runtime}, this layer runs {self.selection.runtime}")
        t, hidden = x.shape[0], self.plan.hidden
        if t > self.selection.mtpr:
            raise ValueError(f"{t} tokens exceed max_tok_per_rank={self.selection.mtpr} (MEGA_MAX_TOKENS_PER_RANK)")
        if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (t, hidden)):
            raise ValueError(f"out must be bf16 {(t, hidden)}, got {out.dtype} {tuple(out.shape)}")
        if t == 0:  # an idle rank still takes part in the collective
            x, ids, weights = self._idle.get(hidden, self.plan.topk, x.device)
        else:
            ids, weights = rank_major_ids(topk_ids, topk_weights, self._owner, self._slot, self.experts_per_rank)
            x = x.to(torch.bfloat16).contiguous()
            ids, weights = ids.to(x.device), weights.to(x.device)
        runtime = self.runtime(layer_weights)
        with normal_tensors():
            result = self._call_runtime(runtime, x, ids, weights, layer_weights)[:t]
        # copied in the caller's mode: ``out`` may be an inference tensor
        return result.clone() if out is None else out.copy_(result)

    __call__ = forward
