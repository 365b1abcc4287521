"""AiterFusedMoE: one MoE layer run end to end by aiter's fused MegaMoE runtime.

    x [T, H] bf16, top-k -> aiter runtime (dispatch over mori -> GEMM1 + SwiGLU -> GEMM2 ->
    combine) -> [T, H] bf16

The runtime owns dispatch and combine, so this object replaces the transport + experts pair of
the unfused layer (``fused = True``); it is what ``provider == "aiter"`` means. Per-layer weights
are prepared once with aiter's own shuffles and handed to every forward explicitly; a shared
runtime's private attributes are never rebound. Not run on AMD hardware.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

import torch

from ...knobs import KnobError
from ...platform.select import Selection, select_backends
from ..weights import ExpertWeights
from .routing import rank_major_ids
from .runtime import (
    BIND_FORWARD,
    BIND_PER_LAYER,
    BIND_SETTER,
    AiterRuntimeSpec,
    build_gfx1250,
    build_v2,
    cco_communicator,
    cco_per_rank_vmm,
    get_runtime,
    param_names,
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
        init_shmem: Callable[[Any], Any] | None = None,
        dist: Any = None,
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
        self.plan, self.group, self.selection = plan, group, selection
        self.device = torch.device(device) if device is not None else None
        self.experts_per_rank = counts.pop()
        self.layer_id = layer_id
        self._import = import_module
        self._cls = runtime_class(selection.runtime, import_module)
        self._owner, self._slot = plan.placement.tables("cpu")
        if init_shmem is None:
            from ...transport.mori import init_mori_shmem

            init_shmem = init_mori_shmem
        self._init_shmem = init_shmem
        self._dist = dist
        self.binding = BIND_FORWARD if selection.runtime == "MegaMoEGfx1250" else v2_binding(self._cls)
        self._runtime = None
        self._forward_params = param_names(self._cls.forward)

    def spec(self) -> AiterRuntimeSpec:
        p, s = self.plan, self.selection
        return AiterRuntimeSpec(
            runtime=s.runtime, rank=p.ep_rank, world_size=p.ep_size, model_dim=p.hidden,
            inter_dim=p.spec.moe_intermediate_size, experts=p.placement.num_physical, topk=p.topk, mtpr=s.mtpr,
            quant=p.math.quant, swiglu_limit=float(p.math.swiglu_limit or 0.0),
            dispatch_backend=s.dispatch_kernel, dispatch_wire=s.dispatch_wire,
            combine_quant=s.combine_quant or "none", a_operand=s.a_operand or "",
            layer_id=self.layer_id if self.binding == BIND_PER_LAYER else None,
        )

    def prepare_weights(self, weights: ExpertWeights) -> AiterLayerWeights:
        if weights.num_experts != self.experts_per_rank:
            raise ValueError(f"weights hold {weights.num_experts} experts, this rank owns {self.experts_per_rank}")
        shuffle = self._import("aiter.ops.shuffle")
        return PREPARERS[self.selection.runtime](weights, shuffle)

    def _build(self, layer_weights: AiterLayerWeights):
        spec = self.spec()
        if spec.runtime == "MegaMoEV2":
            return build_v2(spec, self._cls, layer_weights, self.group, self._init_shmem)
        vmm = cco_per_rank_vmm(spec.world_size, spec.model_dim, spec.mtpr)
        comm = cco_communicator(self.group, spec.rank, spec.world_size, vmm, dist=self._dist, cco=self._import("mori.cco"))
        return build_gfx1250(spec, self._cls, self.group, comm, _AiterEnums(self._import))

    def runtime(self, layer_weights: AiterLayerWeights):
        if self._runtime is None:
            self._runtime, created = get_runtime(self.spec(), self.group, lambda: self._build(layer_weights))
            if created:
                logger.info(self.startup_line())
        return self._runtime

    def startup_line(self) -> str:
        s = self.selection
        extra = f" combine_quant={s.combine_quant}" if s.combine_quant else ""
        return (
            f"[megamoe] aiter {s.runtime}: ep_rank={self.plan.ep_rank} ep_size={self.plan.ep_size} "
            f"dispatch={s.dispatch_kernel} transport={s.transport} wire={s.dispatch_wire} combine={s.combine_wire}{extra} "
            f"a_operand={s.a_operand} mtpr={s.mtpr} weights={self.binding} (not validated on AMD hardware)"
        )

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer_weights: AiterLayerWeights) -> torch.Tensor:
        if layer_weights.runtime != self.selection.runtime:
            raise ValueError(f"weights were prepared for {layer_weights.runtime}, this layer runs {self.selection.runtime}")
        t = x.shape[0]
        if t > self.selection.mtpr:
            raise ValueError(f"{t} tokens exceed max_tok_per_rank={self.selection.mtpr} (MEGA_MAX_TOKENS_PER_RANK)")
        ids, weights = rank_major_ids(topk_ids, topk_weights, self._owner, self._slot, self.experts_per_rank)
        x = x.to(torch.bfloat16).contiguous()
        ids, weights = ids.to(x.device), weights.to(x.device)
        runtime = self.runtime(layer_weights)
        w = dict(w1=layer_weights.w1, w1_scale=layer_weights.w1_scale, w2=layer_weights.w2, w2_scale=layer_weights.w2_scale)
        if self.selection.runtime == "MegaMoEGfx1250":
            kwargs = dict(w)
            if "combine_quant" in self._forward_params:
                kwargs["combine_quant"] = self.selection.combine_quant or "none"
            return runtime.forward(x, weights, ids, **kwargs)
        if self.binding == BIND_FORWARD:
            return runtime.forward(x, weights, ids, **w)
        if self.binding == BIND_SETTER:
            runtime.set_weights(w["w1"], w["w1_scale"], w["w2"], w["w2_scale"])
        return runtime.forward(x, weights, ids)

    __call__ = forward
