"""Fake aiter.ops.flydsl.kernels.mega_moe.MegaMoEV2 as of ROCm/aiter 4d06fb8d (mega_moe_v2.py).

Constructor: keyword-only rank, world_size, model_dim, inter_dim, experts, topk, quant, w1,
w1_scale, w2, w2_scale, max_tok_per_rank, mega_scheme="fixedslot", swiglu_limit=0.0,
fanout_masks=(). Upstream facts it copies, each failing as aiter fails:
- quant "a8w4" only; experts % world_size; a power-of-two max_tok_per_rank (lines 44-49);
  ``0 < topk <= 16`` (57-58); swiglu_limit >= 0 (72-73);
- ``self._bundle_plan = build_mega_moe_bundle_plan(mtpr, experts_per_rank=, model_dim=, inter_dim=,
  world_size=)`` (61-67): every refusal of the plan builder (mega_moe_config.py) is a ValueError of
  the constructor, and the plan's ``fixed_slot_dispatch`` decides the buffers (compact = not fixed);
- ``self.dev = torch.device("cuda", rank)`` (74): every buffer lives on the GPU whose index is the
  EP rank, whatever device the process runs on. The fake has no GPUs: a CPU tensor counts as being
  on ``aiter.FAKE_GPU["current"]`` (the process's current device, set by tests), so a weight handed
  to a runtime built for another rank fails its device check, as on a node whose EP rank is not
  the local device index;
- world_size <= 8 (the intranode op it builds, flydsl_dispatch_combine_intranode_op.py:37, 749);
- it allocates on mori's symmetric heap, buffer by buffer (as at e4048607: intranode op
  ``_alloc_buffers`` 657-697, group-major ``_alloc`` 435-505, ``_allocate_dispatch_workspace``):
  a full heap is ``AssertionError: mori_shmem.shmem_malloc failed`` (mori tensor_utils.py:50);
- ``forward(x_bf16, wts, topk_ids, *, stream=None, slice_output=True, mask_invalid_slots=None,
  w1=None, w1_scale=None, w2=None, w2_scale=None, config_tokens=None)``:
  per-layer weights all four or none, each one byte per element, the prepared numel, on
  ``self.dev``, contiguous ("per-layer weights must match the prepared geometry"); T = 0 is a
  valid call (``entry_for_tokens(0)`` takes the first bucket, ``quantize`` returns empty rows);
  ``config_tokens`` "must agree across ranks and cover their source counts": run_tokens <=
  config_tokens <= mtpr ("config_tokens must cover every source rank within MTPR"), and it, not
  the local count, picks the bundle entry -- hence the P2P (combine) wire of the step;
  ``mask_invalid_slots`` (None: ``AITER_MEGA_COMBINE_MASK``, default off): a -1 top-k slot was never
  dispatched and its partial is stale unless masked -- the fake adds NaN for it, so an adapter that
  passes -1 ids without the mask fails loudly;
- its result is a view of the combine output buffer, rewritten by the next forward.
forward computes this rank's experts' share (fakes/aiter/_moe_math.py) into that buffer; an entry
whose P2P wire is fp8_blockwise_1x32 rounds the share through fp8 e4m3 with one E8M0-style
power-of-two scale per 1x32 block, as that wire carries it.
"""

import torch
from aiter import CALL_LOG, FAKE_GPU
from aiter._moe_math import fp8_blockwise_1x32, local_moe

from . import envs
from .mega_moe_config import build_mega_moe_bundle_plan

_MAX_INTRANODE_NPES = 8


def _create(shape, dtype):
    """A symmetric buffer the fake never touches: counted on the heap, not allocated."""
    from mori.shmem import mori_shmem_create_tensor

    return mori_shmem_create_tensor(shape, dtype, count_only=True)


def fake_device_of(t: torch.Tensor) -> torch.device:
    """Where the fake says a tensor lives: CPU tensors are on the process's current (fake) GPU."""
    return torch.device("cuda", FAKE_GPU["current"]) if t.device.type == "cpu" else t.device


class MegaMoEV2:
    supports_combine_mask = True
    supports_layer_weights = True

    def __init__(self, *, rank: int, world_size: int, model_dim: int, inter_dim: int, experts: int, topk: int,
                 quant: str, w1: torch.Tensor, w1_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                 max_tok_per_rank: int, mega_scheme: str = "fixedslot", swiglu_limit: float = 0.0,
                 fanout_masks: tuple = ()):
        if quant != "a8w4":
            raise ValueError("MegaMoEV2 currently supports quant='a8w4' only")
        if experts % world_size != 0:
            raise ValueError(f"experts={experts} must be divisible by world_size={world_size}")
        if max_tok_per_rank <= 0 or max_tok_per_rank & (max_tok_per_rank - 1):
            raise ValueError(f"max_tok_per_rank={max_tok_per_rank} must be a power of two")
        if not 0 < topk <= 16:
            raise ValueError(f"MegaMoEV2 topk must be in [1, 16], got {topk}")
        self.rank, self.world_size, self.model_dim, self.inter_dim = rank, world_size, model_dim, inter_dim
        self.epr, self.topk, self.mtpr, self.swiglu_limit = experts // world_size, topk, max_tok_per_rank, swiglu_limit
        self._bundle_plan = build_mega_moe_bundle_plan(max_tok_per_rank, experts_per_rank=self.epr, model_dim=model_dim,
                                                       inter_dim=inter_dim, world_size=world_size)
        if swiglu_limit < 0:
            raise ValueError("swiglu_limit must be non-negative")
        self.dev = torch.device("cuda", rank)
        if world_size > _MAX_INTRANODE_NPES:  # FlyDSLDispatchCombineIntraNodeOp, before any allocation
            raise ValueError(
                f"world_size={world_size} exceeds intranode limit _MAX_INTRANODE_NPES={_MAX_INTRANODE_NPES} "
                "(single-node GPU count); use an inter-node dispatch/combine op for world_size > 8"
            )
        import mori.shmem as ms

        if ms.shmem_npes() != world_size:  # raises first when shmem is not initialised at all
            raise RuntimeError(f"fake MegaMoEV2: P2P tables for {world_size} PEs on a {ms.shmem_npes()}-PE shmem world")
        self.kwargs = dict(rank=rank, world_size=world_size, model_dim=model_dim, inter_dim=inter_dim, experts=experts,
                           topk=topk, quant=quant, max_tok_per_rank=max_tok_per_rank, mega_scheme=mega_scheme,
                           swiglu_limit=swiglu_limit)
        compact = not self._bundle_plan.fixed_slot_dispatch
        self._alloc_intranode_op()
        ms.shmem_barrier_all()
        self.w2, self.w2_scale = w2.contiguous(), w2_scale.contiguous()
        self._s1_w1 = w1.contiguous().view(torch.uint8)
        self._s1_w1_scale = w1_scale.contiguous().view(torch.uint8)
        nvm = self._alloc_group_major(unit=128 if compact else 32, compact=compact)
        self._alloc_workspace(metadata_blocks=-(-nvm // 32))
        self._combine_mask = envs.AITER_MEGA_COMBINE_MASK
        self.forward_calls: list = []
        CALL_LOG.append(("MegaMoEV2", dict(self.kwargs, fixed_slot=not compact, dev=self.dev)))

    def _alloc_intranode_op(self):
        w, h, mt, k = self.world_size, self.model_dim, self.mtpr, self.topk
        mr = w  # effective_max_recv: max_total_recv_tokens = world_size -> one slot per rank
        mr_worst = w * mt
        disp_tb, comb_tb = h, 2 * h  # fp8 dispatch rows, bf16 combine rows
        _create(((mr * disp_tb + 1) // 2,), torch.int16)
        _create((mr * k,), torch.float32)
        _create((mr * k,), torch.int32)
        _create((mr * (h // 32),), torch.int8)
        _create((1,), torch.int32)
        _create((w,), torch.int32)
        _create((mr,), torch.int32)
        _create(((max(mr_worst, mt * k) * comb_tb + 1) // 2,), torch.int16)
        _create((mr_worst * k,), torch.float32)
        _create(((mt * comb_tb + 1) // 2,), torch.int16)  # shmem_comb_out_tok: made real on first use
        self._out = None
        _create((mt * k,), torch.float32)
        _create((w,), torch.int64)

    def _alloc_group_major(self, unit: int, compact: bool) -> int:
        w, h, mt, k, epr = self.world_size, self.model_dim, self.mtpr, self.topk, self.epr
        ll_cap = -(-(w * mt) // unit) * unit
        nvm = w * mt * k + epr * unit if compact else epr * ll_cap + 256
        for shape, dtype in (((w,), torch.int32), ((epr,), torch.int32), ((epr,), torch.int32),
                             ((nvm * h,), torch.int8), ((max(1, nvm * -(-(h // 32) // 4)),), torch.int32),
                             ((nvm,), torch.int32), ((nvm,), torch.float32), ((nvm,), torch.int32),
                             ((w,), torch.int32)):
            _create(shape, dtype)
        if compact:
            for n in (epr, w, epr, w, w * w * epr, w):
                _create((n,), torch.int32)
        return nvm

    def _alloc_workspace(self, metadata_blocks: int):
        w, epr = self.world_size, self.epr
        for n in (w * epr, 2 * w, w * epr, 2 * w, 2 * epr, w, metadata_blocks, 1):
            _create((n,), torch.int32)

    def _layer_weights(self, w1, w1_scale, w2, w2_scale):
        weights = (w1, w1_scale, w2, w2_scale)
        if all(w is None for w in weights):
            return None
        if any(w is None for w in weights):
            raise ValueError("per-layer weights require W13, W2 and both scales")
        e, h, i = self.epr, self.model_dim, self.inter_dim
        expected = (e * 2 * i * h // 2, e * 2 * i * h // 32, e * h * i // 2, e * h * i // 32)
        for w, size in zip(weights, expected):
            if w.element_size() != 1 or w.numel() != size or fake_device_of(w) != self.dev or not w.is_contiguous():
                raise ValueError("per-layer weights must match the prepared geometry")
        return tuple(w.view(torch.uint8) for w in weights)

    def forward(self, x_bf16, wts, topk_ids, *, stream=None, slice_output=True, mask_invalid_slots=None, w1=None,
                w1_scale=None, w2=None, w2_scale=None, config_tokens=None):
        run_tokens = int(x_bf16.shape[0])
        layer = self._layer_weights(w1, w1_scale, w2, w2_scale)
        if layer is not None:
            self._s1_w1, self._s1_w1_scale, self.w2, self.w2_scale = layer
        if run_tokens > self.mtpr:
            raise ValueError(f"run_tokens={run_tokens} > max_tok_per_rank={self.mtpr}")
        if x_bf16.dtype != torch.bfloat16 or not x_bf16.is_contiguous():
            raise ValueError("x_bf16 must be contiguous bfloat16")
        if wts.dtype != torch.float32 or not wts.is_contiguous():
            raise ValueError("wts must be contiguous float32")
        if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
            raise ValueError("topk_ids must be contiguous int32")
        policy_tokens = run_tokens if config_tokens is None else int(config_tokens)
        if policy_tokens < run_tokens or policy_tokens > self.mtpr:
            raise ValueError("config_tokens must cover every source rank within MTPR")
        entry = self._entry_for_tokens(policy_tokens)
        mask = self._combine_mask if mask_invalid_slots is None else bool(mask_invalid_slots)
        weights = (self._s1_w1, self._s1_w1_scale, self.w2, self.w2_scale)
        self.forward_calls.append(dict(x=x_bf16, wts=wts, topk_ids=topk_ids, weights=weights, config_tokens=config_tokens,
                                       bucket=entry.token_bucket, p2p_quant=entry.config.p2p_quant,
                                       mask_invalid_slots=mask_invalid_slots, layer_weights=layer is not None))
        if self._out is None:
            self._out = torch.zeros(self.mtpr, self.model_dim, dtype=torch.bfloat16)
        y = local_moe(x_bf16, wts, topk_ids, *weights, rank=self.rank, experts_per_rank=self.epr,
                      swiglu_limit=self.swiglu_limit)
        if entry.config.p2p_quant == "fp8_blockwise_1x32":
            y = fp8_blockwise_1x32(y)
        if not mask and run_tokens:
            stale = (topk_ids < 0).any(dim=1)
            y[stale] = float("nan")  # a never-dispatched slot's partial: whatever the buffer held
        with torch.inference_mode():  # a kernel's write, invisible to autograd / inference-mode checks
            self._out[:run_tokens] = y.to(torch.bfloat16)
        return self._out[:run_tokens] if slice_output else self._out

    def _entry_for_tokens(self, tokens: int):
        """MegaMoEBundlePlan.entry_for_tokens: the first bucket for 0 (empty ranks still launch)."""
        from .mega_moe_config import nearest_token_bucket

        plan = self._bundle_plan
        if tokens < 0 or tokens > plan.mtpr:
            raise ValueError(f"tokens={tokens} must be in [0, {plan.mtpr}]")
        buckets = tuple(e.token_bucket for e in plan.entries)
        bucket = buckets[0] if tokens == 0 else nearest_token_bucket(tokens, buckets)
        return next(e for e in plan.entries if e.token_bucket == bucket)

    forward_bf16 = forward
    __call__ = forward


class MegaMoEV2LaunchAttrs(MegaMoEV2):
    """A revision between e4048607 and 4d06fb8d as far as the adapter can tell: the plan builder with
    ``world_size=`` (what vLLM 0.34 calls) but a forward without per-layer weights or config_tokens,
    so layers rebind the launch attributes (``_s1_w1``, ``_s1_w1_scale``, ``w2``, ``w2_scale``) as
    vLLM 0.34 does (mega_moe.py:277-282), and an idle rank must send a token."""

    def forward(self, x_bf16, wts, topk_ids, *, stream=None, slice_output=True):
        if int(x_bf16.shape[0]) <= 0:  # e4048607 mega_moe_config.py:91-92 (nearest_token_bucket)
            raise ValueError(f"tokens must be positive, got {int(x_bf16.shape[0])}")
        return super().forward(x_bf16, wts, topk_ids, stream=stream, slice_output=slice_output, mask_invalid_slots=True)

    __call__ = forward
