"""Fake aiter.ops.flydsl.kernels.mega_moe.MegaMoEV2 (ROCm/aiter e4048607, mega_moe_v2.py).

Constructor: keyword-only rank, world_size, model_dim, inter_dim, experts, topk, quant, w1,
w1_scale, w2, w2_scale, max_tok_per_rank, mega_scheme="fixedslot", swiglu_limit=0.0, with the
same first checks (mega_moe_v2.py:33-49). Upstream constraints it copies, each failing as aiter does:
- world_size <= 8: the intranode dispatch op it builds refuses more (ValueError,
  kernels/flydsl_dispatch_combine_intranode_op.py:749-754, checked before any allocation);
- it allocates on mori's symmetric heap, buffer by buffer as upstream does (intranode op
  ``_alloc_buffers`` 657-697 with the config of mega_moe_v2.py:57-62, the group-major op's
  ``_alloc`` 435-505, ``_allocate_dispatch_workspace`` mega_moe_v2.py:129-136): a full heap is
  ``AssertionError: mori_shmem.shmem_malloc failed`` (mori tensor_utils.py:50);
- weights are bound at construction and read by each launch from ``_s1_w1`` / ``_s1_w1_scale`` /
  ``w2`` / ``w2_scale`` (mega_moe_v2.py:67-77, 237, 345); no setter;
- forward needs T > 0: its config selector raises "tokens must be positive" (mega_moe_config.py:91-92);
- its result is a view of the combine output buffer, rewritten by the next forward
  (mega_moe_v2.py:271-278; intranode op 1406-1412).
forward computes this rank's experts' share (fakes/aiter/_moe_math.py) into that buffer.
"""

import torch
from aiter import CALL_LOG
from aiter._moe_math import local_moe

_MAX_INTRANODE_NPES = 8
FIXED_SLOT_MAX_MTPR = 255


def _create(shape, dtype):
    """A symmetric buffer the fake never touches: counted on the heap, not allocated."""
    from mori.shmem import mori_shmem_create_tensor

    return mori_shmem_create_tensor(shape, dtype, count_only=True)


class MegaMoEV2:
    def __init__(self, *, rank: int, world_size: int, model_dim: int, inter_dim: int, experts: int, topk: int,
                 quant: str, w1: torch.Tensor, w1_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                 max_tok_per_rank: int, mega_scheme: str = "fixedslot", swiglu_limit: float = 0.0):
        if quant != "a8w4":
            raise ValueError("MegaMoEV2 currently supports quant='a8w4' only")
        if experts % world_size != 0:
            raise ValueError(f"experts={experts} must be divisible by world_size={world_size}")
        if max_tok_per_rank <= 0 or max_tok_per_rank & (max_tok_per_rank - 1):
            raise ValueError(f"max_tok_per_rank={max_tok_per_rank} must be a power of two")
        if swiglu_limit < 0:
            raise ValueError("swiglu_limit must be non-negative")
        if world_size > _MAX_INTRANODE_NPES:
            raise ValueError(
                f"world_size={world_size} exceeds intranode limit _MAX_INTRANODE_NPES={_MAX_INTRANODE_NPES} "
                "(single-node GPU count); use an inter-node dispatch/combine op for world_size > 8"
            )
        import mori.shmem as ms

        if ms.shmem_npes() != world_size:  # raises first when shmem is not initialised at all
            raise RuntimeError(f"fake MegaMoEV2: P2P tables for {world_size} PEs on a {ms.shmem_npes()}-PE shmem world")
        self.rank, self.world_size, self.model_dim, self.inter_dim = rank, world_size, model_dim, inter_dim
        self.epr, self.topk, self.mtpr, self.swiglu_limit = experts // world_size, topk, max_tok_per_rank, swiglu_limit
        self.kwargs = dict(rank=rank, world_size=world_size, model_dim=model_dim, inter_dim=inter_dim, experts=experts,
                           topk=topk, quant=quant, max_tok_per_rank=max_tok_per_rank, mega_scheme=mega_scheme,
                           swiglu_limit=swiglu_limit)
        compact = max_tok_per_rank > FIXED_SLOT_MAX_MTPR
        self._alloc_intranode_op()
        ms.shmem_barrier_all()
        self.w2, self.w2_scale = w2.contiguous(), w2_scale.contiguous()
        self._s1_w1 = w1.contiguous().view(torch.uint8)
        self._s1_w1_scale = w1_scale.contiguous().view(torch.uint8)
        nvm = self._alloc_group_major(unit=128 if compact else 32, compact=compact)
        self._alloc_workspace(metadata_blocks=-(-nvm // 32))
        self.forward_calls: list = []
        CALL_LOG.append(("MegaMoEV2", self.kwargs))

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

    def forward(self, x_bf16, wts, topk_ids, *, stream=None, slice_output=True):
        run_tokens = int(x_bf16.shape[0])
        if run_tokens > self.mtpr:
            raise ValueError(f"run_tokens={run_tokens} > max_tok_per_rank={self.mtpr}")
        if x_bf16.dtype != torch.bfloat16 or not x_bf16.is_contiguous():
            raise ValueError("x_bf16 must be contiguous bfloat16")
        if wts.dtype != torch.float32 or not wts.is_contiguous():
            raise ValueError("wts must be contiguous float32")
        if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
            raise ValueError("topk_ids must be contiguous int32")
        if run_tokens <= 0:  # _select_config -> nearest_token_bucket
            raise ValueError(f"tokens must be positive, got {run_tokens}")
        weights = (self._s1_w1, self._s1_w1_scale, self.w2, self.w2_scale)
        self.forward_calls.append(dict(x=x_bf16, wts=wts, topk_ids=topk_ids, weights=weights))
        if self._out is None:
            self._out = torch.zeros(self.mtpr, self.model_dim, dtype=torch.bfloat16)
        y = local_moe(x_bf16, wts, topk_ids, *weights, rank=self.rank, experts_per_rank=self.epr,
                      swiglu_limit=self.swiglu_limit)
        with torch.inference_mode():  # a kernel's write, invisible to autograd / inference-mode checks
            self._out[:run_tokens] = y.to(torch.bfloat16)
        return self._out[:run_tokens] if slice_output else self._out

    forward_bf16 = forward
    __call__ = forward


class MegaMoEV2WithSetter(MegaMoEV2):
    """Variant with a public set_weights(w1, w1_scale, w2, w2_scale), as called by a published
    MegaMoEV2 tuning script (its aiter revision is not in the ROCm/aiter snapshot read)."""

    def set_weights(self, w1, w1_scale, w2, w2_scale) -> None:
        self._s1_w1, self._s1_w1_scale = w1.view(torch.uint8), w1_scale.view(torch.uint8)
        self.w2, self.w2_scale = w2, w2_scale
