"""AiterFusedMoE: one MoE layer run end to end by aiter's fused MegaMoE runtimes.

    x [T, H] bf16, top-k -> aiter runtime (dispatch over mori -> GEMM1 + SwiGLU -> GEMM2 ->
    combine) -> [T, H] bf16, owned by the caller

The runtime owns dispatch and combine, so this object replaces the transport + experts pair of
the unfused layer (``fused = True``); it is what ``provider == "aiter"`` means. Runtimes are shared
by every layer (runtime.py); each layer's weights are prepared once with aiter's own shuffles and
reach the runtime at every forward. What shapes the forward, from upstream:
- MegaMoEV2 comes as the runtimes aiter's plan builder gives (``Selection.runtimes``): vLLM 0.34
  holds a fixed-slot one for decode and one at the max and runs each step on the smallest that holds
  the DP-wide token count (mega_moe.py:164-177, 225-238). Here that count is the engine's token
  bound (``max_tokens_across_ranks``, the same on every rank), passed on as ``config_tokens``
  (4d06fb8d MegaMoEV2.forward: "must agree across ranks and cover their source counts"), so every
  rank launches the same bundle entry; without a bound, the largest runtime at its full capacity;
- MegaMoEGfx1250 takes ``recv_token_bound`` (e4048607 mega_moe.py:335-346), the bound times top-k
  times the EP size, as ATOM passes it (mori_v2_prepare_finalize.py:512-535, 587-590);
- ids stay on the device (routing.py; bad ids go to the caller's status word); an entry that does
  not run becomes a zero-weight copy of a valid id, so no -1 reaches the runtime and no mask is
  asked for: 4d06fb8d's ``mask_invalid_slots`` "costs prefill time" (mega_moe/envs.py, "callers
  that pad with -1 ask for it per call") and vLLM 0.34 passes nothing;
- MegaMoEGfx1250 names its quantised combine only on large steps (rocm_rules.gfx1250_step_combine_quant);
- an idle rank still takes part in the collective: where the runtime refuses zero tokens (a
  forward without ``config_tokens``: e4048607 mega_moe_config.py:91) and on gfx1250, it sends one
  zero-weight token, as SGLang's integration does, and returns no rows;
- the result is a view of a buffer the runtime rewrites at its next forward -- any layer's, the
  runtime being shared (mega_moe_v2.py:271-278, mega_moe_gfx1250/mega_moe.py:745-750) -- so it is
  copied out (into ``out`` when given) before the next layer can run;
- the heap the runtimes need is checked at construction, before anything is allocated (heap.py).
Not run on AMD hardware.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any, Callable, Mapping

import torch

from ...knobs import KnobError
from ...platform.rocm_probes import MoEShape
from ...platform.rocm_rules import check_gfx1250_shapes, check_v2_device, gfx1250_step_combine_quant
from ...platform.select import RocmAsk, Selection, select_backends
from ..weights import ExpertWeights
from .routing import rank_major_ids
from .runtime import (
    BIND_ATTRS,
    BIND_FORWARD,
    AiterRuntimeSpec,
    bind_launch_attrs,
    build_gfx1250,
    build_v2,
    cco_communicator,
    get_runtime,
    normal_tensors,
    param_names,
    plan_shmem,
    runtime_class,
    v2_binding,
)
from .heap import cco_per_rank_vmm
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
        hip: Any = None,
    ) -> None:
        if selection is None:
            from ...platform.facts import detect_facts

            ask = RocmAsk(shape=MoEShape(plan.hidden, plan.spec.moe_intermediate_size, plan.topk), ep_rank=plan.ep_rank,
                          device_index=getattr(torch.device(device), "index", None) if device is not None else None)
            selection = select_backends(facts or detect_facts(), plan.knobs, plan.math, ep_size=plan.ep_size,
                                        num_experts=plan.placement.num_physical, rocm=ask)
        if not selection.fused:
            raise KnobError(f"aiter's fused MegaMoE cannot run this plan: {'; '.join(selection.reasons)}")
        counts = {plan.placement.num_local(r) for r in range(plan.ep_size)}
        if len(counts) != 1:
            raise KnobError(f"aiter MegaMoE needs the same expert count on every rank; placement has {sorted(counts)}")
        self.device = torch.device(device) if device is not None else None
        if selection.runtime == "MegaMoEGfx1250":
            check_gfx1250_shapes(plan.hidden, plan.spec.moe_intermediate_size)
        elif self.device is not None and self.device.type == "cuda":
            wrong = check_v2_device(plan.ep_rank, self.device.index)
            if wrong:
                raise KnobError(f"[megamoe] {wrong}; serve with MEGA_DISPATCH=mori (unfused) on this layout")
        self.plan, self.group, self.selection = plan, group, selection
        self.experts_per_rank = counts.pop()
        self.layer_id = layer_id
        self._import = import_module
        self._cls = runtime_class(selection.runtime, import_module)
        self._owner, self._slot = plan.placement.tables("cpu")
        self._dist, self._hip = dist, hip
        self.binding = BIND_FORWARD if selection.runtime == "MegaMoEGfx1250" else v2_binding(self._cls)
        self._forward_params = param_names(self._cls.forward)
        # 4d06fb8d MegaMoEV2.forward: config_tokens, and T = 0 is a valid call
        self._takes_config_tokens = "config_tokens" in self._forward_params
        # what aiter's gfx1250 fused_moe reads at each forward (ATOM logs the same raw value)
        self._force_a8w4_raw = (os.environ if env is None else env).get("AITER_FORCE_A8W4", "0")
        self._runtimes: dict[int, Any] = {}
        self._idle = _IdleToken()
        self.specs = self._runtime_specs()
        self.shmem_bytes = plan_shmem(self.specs, group, env)

    def _runtime_specs(self) -> list[AiterRuntimeSpec]:
        """One spec per runtime the layers share, ascending capacity."""
        p, s = self.plan, self.selection
        base = dict(
            runtime=s.runtime, rank=p.ep_rank, world_size=p.ep_size, model_dim=p.hidden,
            inter_dim=p.spec.moe_intermediate_size, experts=p.placement.num_physical, topk=p.topk,
            quant=p.math.quant, swiglu_limit=float(p.math.swiglu_limit or 0.0),
            dispatch_backend=s.dispatch_kernel, dispatch_wire=s.dispatch_wire, stage1_fused=s.stage1_fused,
            combine_quant=s.combine_quant or "none", a_operand=s.a_operand or "",
            device=str(self.device) if self.device is not None else "",
        )
        if s.runtime == "MegaMoEV2":
            return [AiterRuntimeSpec(mtpr=r.capacity, fixed_slot=r.fixed_slot, **base) for r in s.runtimes]
        return [AiterRuntimeSpec(mtpr=s.mtpr, **base)]

    @property
    def capacity(self) -> int:
        return self.specs[-1].mtpr

    def spec_for(self, bound: int | None) -> AiterRuntimeSpec:
        """The smallest runtime holding ``bound`` tokens per rank (the largest without a bound)."""
        need = self.capacity if bound is None else int(bound)
        return next(s for s in self.specs if need <= s.mtpr)

    def prepare_weights(self, weights: ExpertWeights) -> AiterLayerWeights:
        if weights.num_experts != self.experts_per_rank:
            raise ValueError(f"weights hold {weights.num_experts} experts, this rank owns {self.experts_per_rank}")
        shuffle = self._import("aiter.ops.shuffle")
        return PREPARERS[self.selection.runtime](weights, shuffle)

    def _init_shmem(self) -> None:
        from ...transport.mori import init_mori_shmem

        init_mori_shmem(self.group, self.plan.ep_rank, self.plan.ep_size, shmem=self._import("mori.shmem"), dist=self._dist)

    def _build(self, spec: AiterRuntimeSpec, layer_weights: AiterLayerWeights):
        if spec.runtime == "MegaMoEV2":
            return build_v2(spec, self._cls, layer_weights, self._init_shmem)
        vmm = cco_per_rank_vmm(spec.world_size, spec.model_dim, spec.mtpr)
        comm = cco_communicator(self.group, spec.rank, spec.world_size, vmm, dist=self._dist, cco=self._import("mori.cco"),
                                hip=self._hip)
        return build_gfx1250(spec, self._cls, comm, _AiterEnums(self._import))

    def runtime(self, layer_weights: AiterLayerWeights, bound: int | None = None):
        """The shared runtime for a step of ``bound`` tokens per rank, built (every runtime) on first use."""
        if not self._runtimes:
            self.build(layer_weights)
        return self._runtimes[self.spec_for(bound).mtpr]

    def build(self, layer_weights: AiterLayerWeights) -> None:
        """Build (or find) every runtime this layer uses: at start-up, before an engine captures graphs."""
        for spec in self.specs:
            if spec.mtpr not in self._runtimes:
                self._runtimes[spec.mtpr], created = get_runtime(spec, self.group, lambda s=spec: self._build(s, layer_weights))
                if created:
                    logger.info(self.startup_line(spec))
                    if spec is self.specs[-1]:
                        logger.info("[megamoe] aiter %s plan: %s", self.selection.runtime, "; ".join(self.selection.reasons))

    def startup_line(self, spec: AiterRuntimeSpec | None = None) -> str:
        """One line per runtime built. It carries the raw fields ATOM logs for the same runtime, spelled as
        ATOM spells them, so an operator's grep finds them ("[MORI-V2] Created MegaMoE: ... dispatch=%s
        stage1_fused=%s wire=%s combine_quant=%s force_a8w4=%s", ATOM mori_v2_prepare_finalize.py
        ``init_mega_transport``), then the project's own (combine=, a_operand=, mtpr=, runtimes=, ...)."""
        s = self.selection
        spec = spec or self.specs[-1]
        heap = f" shmem={self.shmem_bytes / (1 << 30):.2f}GiB" if self.shmem_bytes else ""
        runtimes = f" runtimes={'+'.join(r.describe() for r in s.runtimes)}" if s.runtimes else ""
        upstream = (f"dispatch={s.dispatch_kernel} stage1_fused={s.stage1_fused} wire={s.dispatch_wire} "
                    f"combine_quant={s.combine_quant or 'none'} force_a8w4={self._force_a8w4_raw}")
        return (
            f"[megamoe] aiter {s.runtime}: ep_rank={self.plan.ep_rank} ep_size={self.plan.ep_size} {upstream} "
            f"transport={s.transport} combine={s.combine_wire} a_operand={s.a_operand} "
            f"mtpr={spec.mtpr}{' fixed-slot' if spec.fixed_slot else ''}{runtimes} "
            f"weights={self.binding} shared by all layers{heap} (not validated on AMD hardware)"
        )

    def _step_args(self, spec: AiterRuntimeSpec, bound: int | None) -> dict:
        """Per-step arguments the installed class takes: the config bucket every rank agrees on,
        gfx1250's static recv bound and (on large steps only) its quantised combine."""
        p, kw = self.plan, {}
        if self.selection.runtime == "MegaMoEGfx1250":
            step_quant = gfx1250_step_combine_quant(self.selection.combine_quant or "none", bound)
            if step_quant != "none" and "combine_quant" in self._forward_params:
                kw["combine_quant"] = step_quant
            arena = p.ep_size * spec.mtpr
            if bound is not None and "recv_token_bound" in self._forward_params and bound * p.topk * p.ep_size < arena:
                kw["recv_token_bound"] = int(bound) * p.topk * p.ep_size
            return kw
        if self._takes_config_tokens:
            kw["config_tokens"] = spec.mtpr if bound is None else int(bound)
        return kw

    def _call_runtime(self, runtime, x, ids, weights, lw: AiterLayerWeights, step: dict):
        w = dict(w1=lw.w1, w1_scale=lw.w1_scale, w2=lw.w2, w2_scale=lw.w2_scale)
        if self.binding == BIND_FORWARD:
            return runtime.forward(x, weights, ids, **w, **step)
        if self.binding == BIND_ATTRS:
            bind_launch_attrs(runtime, lw)
        return runtime.forward(x, weights, ids, **step)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer_weights: AiterLayerWeights,
        out: torch.Tensor | None = None, bound: int | None = None,
    ) -> torch.Tensor:
        """-> bf16 [T, H] the caller owns: ``out`` when given (bf16 [T, H]), else a new tensor.

        ``bound``: the engine's token bound for this step (the same on every EP rank, >= T);
        None runs the largest runtime at its capacity."""
        if layer_weights.runtime != self.selection.runtime:
            raise ValueError(f"weights were prepared for {layer_weights.runtime}, this layer runs {self.selection.runtime}")
        t, hidden = x.shape[0], self.plan.hidden
        if t > self.capacity or (bound is not None and not t <= bound <= self.capacity):
            raise ValueError(f"{t} tokens / bound {bound} exceed max_tok_per_rank={self.capacity} (MEGA_MAX_TOKENS_PER_RANK)")
        if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (t, hidden)):
            raise ValueError(f"out must be bf16 {(t, hidden)}, got {out.dtype} {tuple(out.shape)}")
        spec = self.spec_for(bound)
        idle = t == 0 and (self.selection.runtime == "MegaMoEGfx1250" or not self._takes_config_tokens)
        if idle:  # an idle rank still takes part in the collective
            x, ids, weights = self._idle.get(hidden, self.plan.topk, x.device)
        else:
            owner, slot = self._owner.to(x.device), self._slot.to(x.device)
            ids, weights = rank_major_ids(topk_ids, topk_weights, owner, slot, self.experts_per_rank)
            x = x.to(torch.bfloat16).contiguous()
        runtime = self.runtime(layer_weights, bound)
        with normal_tensors():
            result = self._call_runtime(runtime, x, ids, weights, layer_weights, self._step_args(spec, bound))[:t]
        # copied in the caller's mode: ``out`` may be an inference tensor
        return result.clone() if out is None else out.copy_(result)

    __call__ = forward

