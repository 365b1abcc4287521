"""Fake aiter.ops.flydsl.kernels.mega_moe_gfx1250.MegaMoEGfx1250, in two published shapes:

- ``MegaMoEGfx1250_e4048607``: ROCm/aiter e4048607 (2026-08-22). dispatch_backend only (None ->
  $MEGA_DISPATCH, default "flydsl"); bf16 dispatch wire.
- ``MegaMoEGfx1250_22f2e2dc``: yhl-amd/aiter 22f2e2dc. Adds dispatch_wire (None ->
  $MEGA_DISPATCH_WIRE), stage1_fused, combine_quant (None -> $MEGA_COMBINE_QUANT) to __init__ and
  next_topk_ids / next_recv_token_bound / combine_quant to forward.
``MegaMoEGfx1250`` names the first; tests rebind it. Checks are restated from those files, and
the ones that fail quietly upstream fail the same way here:
- the combine output is one buffer (mega_moe.py:497-501) returned as a view and rewritten by the
  next forward (745-750);
- the fused combine reads what aiter's grouped gfx1250 kernel scattered; ``fused_moe`` calls that
  kernel with A = fp8 when AITER_FORCE_A8W4 reads "1" on gfx1250, else fp4x2 (fused_moe.py:799-803),
  and the kernel takes a4w4 only for ``w1.dtype == fp4x2`` and a8w4 for fp4x2 or uint8 weights
  (grouped_moe_gfx1250.py:991-996). Otherwise fused_moe's generic path runs, ignores
  stage2_scatter, and the combine returns the buffer as the last step left it (zeros at first);
- the mori dispatch variant zeroes ``_total_recv`` in place each forward (mega_moe.py:628): built
  inside torch.inference_mode, that is an inference tensor, and a later forward outside it fails;
- construction allocates (its arena and buffers, mega_moe.py:462-500): a HIP last error left by cco
  init (fakes/fake_hip.py) is raised there, as torch's next error check raises it;
- a quantised wire on the mori dispatch asks mori's ``hip_backend.scale_stride_bytes`` for the row's
  stride and builds ``ep_plans.EpDispatchPlan(scale_bytes=)``: a mori without ROCm/mori#593 has
  neither (fakes/mori/ops/dispatch_combine_v2/: RuntimeError at build, as aiter raises it);
- 22f2e2dc: ``stage1_fused`` needs the flydsl dispatch and an fp8 / fp4 wire (the compact plan
  carries the scale row itself); topk in [1, 32] (the wave size);
- ``forward(..., recv_token_bound=None)`` (e4048607 mega_moe.py:335-346): a Python int capping the
  recv slots the GEMM sees, never below the received count; recorded per call.
forward computes this rank's experts' share (fakes/aiter/_moe_math.py).
"""

import os

import fake_hip
import torch
from aiter import CALL_LOG, ActivationType, QuantType, dtypes
from aiter._moe_math import local_moe
from aiter.jit.utils.chip_info import get_gfx
from aiter.ops.flydsl.moe_common import GateMode

_DISPATCH_BACKENDS = ("flydsl", "mori")
_DISPATCH_WIRES = ("bf16", "fp8", "fp4")
_COMBINE_QUANT_MODES = ("none", "mxfp8", "mxfp4")
_WAVE_SIZE = 32  # config.py:6; MegaMoEConfig: "dispatch requires topk in [1, _WAVE_SIZE]"


class _Base:
    def _check(self, *, communicator, rank, world_size, model_dim, inter_dim, experts, topk, max_tokens_per_rank,
               activation, gate_mode, quant_type, swiglu_limit, dispatch_backend):
        if get_gfx() != "gfx1250":
            raise RuntimeError(f"MegaMoEGfx1250 requires gfx1250, got {get_gfx()}")
        if experts % world_size:
            raise ValueError(f"experts={experts} must be divisible by world_size={world_size}")
        if topk > experts:
            raise ValueError(f"topk={topk} cannot exceed experts={experts}")
        if swiglu_limit < 0:
            raise ValueError(f"swiglu_limit must be non-negative, got {swiglu_limit}")
        if GateMode(gate_mode) != GateMode.INTERLEAVE:
            raise ValueError("MegaMoE fused stage2 scatter requires gate_mode=INTERLEAVE")
        if QuantType(quant_type) != QuantType.per_1x32:
            raise ValueError("MegaMoE fused stage2 scatter requires quant_type=per_1x32")
        if ActivationType(activation) not in (ActivationType.Silu, ActivationType.Swiglu, ActivationType.Situv2):
            raise ValueError(f"unsupported activation={activation}")
        if communicator is None:
            raise ValueError("communicator (mori.cco.Communicator) is required")
        backend = dispatch_backend if dispatch_backend is not None else os.environ.get("MEGA_DISPATCH", "flydsl")
        if backend not in _DISPATCH_BACKENDS:
            raise ValueError(f"dispatch_backend must be one of {_DISPATCH_BACKENDS}, got {backend!r}")
        fake_hip.raise_if_pending("MegaMoEGfx1250.__init__ (first allocation)")
        self.rank, self.experts_per_rank = rank, experts // world_size
        self.model_dim, self.inter_dim, self.topk, self.mtpr = model_dim, inter_dim, topk, max_tokens_per_rank
        self.swiglu_limit = swiglu_limit
        self.forward_calls: list = []
        self._total_recv = torch.zeros(1, dtype=torch.int32)
        self._combine_output = torch.zeros(max_tokens_per_rank * model_dim, dtype=torch.int16)
        return backend

    def _run(self, hidden_states, topk_weights, topk_ids, w1, w2, w1_scale, w2_scale, t):
        """dispatch -> fused_moe -> combine, as far as the fake models them; returns the combine view."""
        if self.config["dispatch_backend"] == "mori":
            self._total_recv.zero_()
        a_fp8 = os.environ.get("AITER_FORCE_A8W4", "0") in ("1")
        grouped = (w1.dtype == dtypes.fp4x2) if not a_fp8 else w1.dtype in (dtypes.fp4x2, torch.uint8)
        if grouped:
            y = local_moe(hidden_states, topk_weights, topk_ids, w1, w1_scale, w2, w2_scale, rank=self.rank,
                          experts_per_rank=self.experts_per_rank, swiglu_limit=self.swiglu_limit)
            with torch.inference_mode():  # a kernel's write
                self._combine_output[: t * self.model_dim].view(torch.bfloat16).copy_(y.to(torch.bfloat16).view(-1))
        return self._combine_output[: t * self.model_dim].view(torch.bfloat16).view(t, self.model_dim)

    def _check_recv_bound(self, bound) -> None:
        if bound is not None and (not isinstance(bound, int) or bound < 1):
            raise ValueError(f"recv_token_bound must be a positive python int, got {bound!r}")

    def _check_forward(self, hidden_states, topk_weights, topk_ids, w1, w2, w1_scale, w2_scale):
        if hidden_states.dtype != torch.bfloat16 or not hidden_states.is_contiguous():
            raise ValueError("hidden_states must be contiguous bfloat16")
        if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
            raise ValueError("topk_weights must be contiguous float32")
        if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
            raise ValueError("topk_ids must be contiguous int32")
        if w1_scale is None or w2_scale is None:
            raise ValueError("MegaMoE fused stage2 scatter requires both w1_scale and w2_scale")
        if w1.dtype not in (torch.uint8, dtypes.fp4x2) or w2.dtype not in (torch.uint8, dtypes.fp4x2):
            raise ValueError("MegaMoE fused stage2 scatter requires MXFP4 w1/w2 weights")
        e, h, i = self.experts_per_rank, self.model_dim, self.inter_dim
        if tuple(w1.shape) != (e, 2 * i, h // 2):
            raise ValueError(f"requires interleaved G1U1 w1 with shape {(e, 2 * i, h // 2)}, got {tuple(w1.shape)}")
        if tuple(w2.shape) != (e, h, i // 2):
            raise ValueError(f"requires w2 shape {(e, h, i // 2)}, got {tuple(w2.shape)}")
        t = int(hidden_states.shape[0])
        if t > self.mtpr:
            raise ValueError(f"tokens={t} exceeds max_tokens_per_rank={self.mtpr}")
        if tuple(topk_ids.shape) != (t, self.topk) or tuple(topk_weights.shape) != (t, self.topk):
            raise ValueError("topk shapes")
        return t


class MegaMoEGfx1250_e4048607(_Base):
    def __init__(self, *, communicator, rank: int, world_size: int, model_dim: int, inter_dim: int, experts: int,
                 topk: int, max_tokens_per_rank: int, activation=ActivationType.Silu,
                 gate_mode: int = GateMode.INTERLEAVE.value, quant_type=QuantType.per_1x32, hidden_pad: int = 0,
                 intermediate_pad: int = 0, swiglu_limit: float = 0.0, situ_beta=None, situ_linear_beta=None,
                 dispatch_backend: str | None = None):
        backend = self._check(communicator=communicator, rank=rank, world_size=world_size, model_dim=model_dim,
                              inter_dim=inter_dim, experts=experts, topk=topk, max_tokens_per_rank=max_tokens_per_rank,
                              activation=activation, gate_mode=gate_mode, quant_type=quant_type,
                              swiglu_limit=swiglu_limit, dispatch_backend=dispatch_backend)
        self.config = dict(dispatch_backend=backend, dispatch_wire="bf16", combine_quant="none")
        CALL_LOG.append(("MegaMoEGfx1250", dict(rank=rank, world_size=world_size, model_dim=model_dim,
                         inter_dim=inter_dim, experts=experts, topk=topk, max_tokens_per_rank=max_tokens_per_rank,
                         activation=activation, gate_mode=gate_mode, quant_type=quant_type,
                         swiglu_limit=swiglu_limit, **self.config)))

    def forward(self, hidden_states, topk_weights, topk_ids, *, w1, w2, w1_scale, w2_scale, bias1=None, bias2=None,
                a1_scale=None, a2_scale=None, recv_token_bound=None):
        t = self._check_forward(hidden_states, topk_weights, topk_ids, w1, w2, w1_scale, w2_scale)
        self._check_recv_bound(recv_token_bound)
        self.forward_calls.append(dict(x=hidden_states, wts=topk_weights, ids=topk_ids, w1=w1, w2=w2,
                                       w1_scale=w1_scale, w2_scale=w2_scale, recv_token_bound=recv_token_bound))
        return self._run(hidden_states, topk_weights, topk_ids, w1, w2, w1_scale, w2_scale, t)

    __call__ = forward


class MegaMoEGfx1250_22f2e2dc(_Base):
    def __init__(self, *, communicator, rank: int, world_size: int, model_dim: int, inter_dim: int, experts: int,
                 topk: int, max_tokens_per_rank: int, activation=ActivationType.Silu,
                 gate_mode: int = GateMode.INTERLEAVE.value, quant_type=QuantType.per_1x32, hidden_pad: int = 0,
                 intermediate_pad: int = 0, swiglu_limit: float = 0.0, situ_beta=None, situ_linear_beta=None,
                 dispatch_backend: str | None = None, dispatch_wire: str | None = None, stage1_fused: bool = False,
                 combine_quant: str | None = None):
        backend = self._check(communicator=communicator, rank=rank, world_size=world_size, model_dim=model_dim,
                              inter_dim=inter_dim, experts=experts, topk=topk, max_tokens_per_rank=max_tokens_per_rank,
                              activation=activation, gate_mode=gate_mode, quant_type=quant_type,
                              swiglu_limit=swiglu_limit, dispatch_backend=dispatch_backend)
        wire = dispatch_wire if dispatch_wire is not None else (os.environ.get("MEGA_DISPATCH_WIRE") or "bf16")
        cq = combine_quant if combine_quant is not None else os.environ.get("MEGA_COMBINE_QUANT", "none")
        if wire not in _DISPATCH_WIRES:
            raise ValueError(f"dispatch_wire must be one of {_DISPATCH_WIRES}, got {wire!r}")
        if wire != "bf16" and model_dim % 32:
            raise ValueError("a quantizing dispatch wire needs hidden_dim % 32 == 0")
        if cq not in _COMBINE_QUANT_MODES:
            raise ValueError(f"combine_quant must be one of {_COMBINE_QUANT_MODES}, got {cq!r}")
        if stage1_fused and (backend != "flydsl" or wire == "bf16"):
            raise ValueError("stage1_fused requires dispatch_backend='flydsl' and an fp8 or fp4 dispatch wire")
        if not 0 < topk <= _WAVE_SIZE:
            raise ValueError(f"dispatch requires topk in [1, {_WAVE_SIZE}], got {topk}")
        if backend == "mori" and wire != "bf16":  # the sender-quantised rows travel with their E8M0 scale row
            self._build_mori_scale_dispatch(world_size, model_dim, max_tokens_per_rank, experts // world_size, topk, wire)
        self.config = dict(dispatch_backend=backend, dispatch_wire=wire, combine_quant=cq)
        self.stage1_fused = bool(stage1_fused)
        CALL_LOG.append(("MegaMoEGfx1250", dict(rank=rank, world_size=world_size, model_dim=model_dim,
                         inter_dim=inter_dim, experts=experts, topk=topk, max_tokens_per_rank=max_tokens_per_rank,
                         activation=activation, gate_mode=gate_mode, quant_type=quant_type,
                         swiglu_limit=swiglu_limit, stage1_fused=stage1_fused, **self.config)))

    @staticmethod
    def _build_mori_scale_dispatch(world_size, model_dim, mtpr, experts_per_rank, topk, wire):
        """MegaMoEConfig.dispatch_scale_dst_nbytes + _build_mori_dispatch: the stride is asked of mori's
        ``hip_backend.scale_stride_bytes`` (an ImportError -> RuntimeError "needs a mori whose EP dispatch
        carries a per-token scale row (ROCm/mori#593 or later)"), and ``EpDispatchPlan(scale_bytes=)``."""
        try:
            from mori.ops.dispatch_combine_v2.hip_backend import scale_stride_bytes
        except ImportError as exc:
            raise RuntimeError(f"dispatch_wire={wire!r} needs a mori whose EP dispatch carries a per-token scale row "
                               "(ROCm/mori#593 or later); the installed one has no scale_stride_bytes") from exc
        from mori.ops.dispatch_combine_v2.ep_plans import EpDispatchPlan

        scale_bytes = model_dim // 32
        scale_stride_bytes(scale_bytes)
        EpDispatchPlan(world_size=world_size, hidden_dim=model_dim // 2 if wire == "fp4" else model_dim,
                       max_tok_per_rank=mtpr, num_expert_per_rank=experts_per_rank, num_expert_per_token=topk,
                       max_recv=world_size * mtpr, dtype=torch.uint8, use_weights=True, scale_bytes=scale_bytes)

    def forward(self, hidden_states, topk_weights, topk_ids, *, w1, w2, w1_scale, w2_scale, bias1=None, bias2=None,
                a1_scale=None, a2_scale=None, recv_token_bound=None, next_topk_ids=None, next_recv_token_bound=None,
                combine_quant=None):
        t = self._check_forward(hidden_states, topk_weights, topk_ids, w1, w2, w1_scale, w2_scale)
        step = combine_quant or "none"
        if step != "none" and step != self.config["combine_quant"]:
            raise ValueError(f"combine_quant={step!r} was not built at construction ({self.config['combine_quant']!r})")
        self._check_recv_bound(recv_token_bound)
        self.forward_calls.append(dict(x=hidden_states, wts=topk_weights, ids=topk_ids, w1=w1, w2=w2,
                                       w1_scale=w1_scale, w2_scale=w2_scale, combine_quant=step,
                                       recv_token_bound=recv_token_bound))
        return self._run(hidden_states, topk_weights, topk_ids, w1, w2, w1_scale, w2_scale, t)

    __call__ = forward


MegaMoEGfx1250 = MegaMoEGfx1250_e4048607
