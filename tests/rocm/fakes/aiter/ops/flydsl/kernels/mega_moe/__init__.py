"""Fake aiter.ops.flydsl.kernels.mega_moe.MegaMoEV2 (ROCm/aiter e4048607, mega_moe_v2.py).

Constructor: keyword-only rank, world_size, model_dim, inter_dim, experts, topk, quant, w1,
w1_scale, w2, w2_scale, max_tok_per_rank, mega_scheme="fixedslot", swiglu_limit=0.0; the same
first checks (quant == "a8w4", experts % world_size, power-of-two max_tok_per_rank, swiglu_limit
>= 0). It runs on mori shmem (the real one builds a FlyDSL dispatch op on the shmem heap and calls
mori.shmem.shmem_barrier_all()), so the fake refuses to build before shmem is initialised.
forward(x_bf16, wts, topk_ids, *, stream=None, slice_output=True) checks dtypes as the real one
and returns zeros; weights are bound at construction (no setter), as published.
"""

import torch
from aiter import CALL_LOG


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
        import mori.shmem as ms

        if not ms._STATE.get("group_name"):
            raise RuntimeError("fake MegaMoEV2: mori shmem is not initialised (the real op allocates on the shmem heap)")
        ms.shmem_barrier_all()
        self.kwargs = dict(rank=rank, world_size=world_size, model_dim=model_dim, inter_dim=inter_dim, experts=experts,
                           topk=topk, quant=quant, max_tok_per_rank=max_tok_per_rank, mega_scheme=mega_scheme,
                           swiglu_limit=swiglu_limit)
        self.model_dim, self.topk, self.mtpr = model_dim, topk, max_tok_per_rank
        self.bound = (w1, w1_scale, w2, w2_scale)
        self.forward_calls: list = []
        CALL_LOG.append(("MegaMoEV2", self.kwargs))

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
        self.forward_calls.append(dict(x=x_bf16, wts=wts, topk_ids=topk_ids, weights=self.bound))
        return torch.zeros(run_tokens, self.model_dim, dtype=torch.bfloat16)

    forward_bf16 = forward
    __call__ = forward


class MegaMoEV2WithSetter(MegaMoEV2):
    """Variant with a public set_weights(w1, w1_scale, w2, w2_scale), as called by a published
    MegaMoEV2 tuning script (its aiter revision is not in the ROCm/aiter snapshot read)."""

    def set_weights(self, w1, w1_scale, w2, w2_scale) -> None:
        self.bound = (w1, w1_scale, w2, w2_scale)
