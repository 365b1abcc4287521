"""Fake mori.ops.dispatch_combine_v2.ep_plans.EpDispatchPlan: what aiter's MegaMoEGfx1250 builds for its
mori dispatch (aiter gfx1250 mega_moe.py ``_build_mori_dispatch``). mori "rejects UNKNOWN kwargs
outright" (aiter's comment there), so ``scale_bytes=`` is a TypeError before #593 and accepted after."""

from ... import CALL_LOG


class EpDispatchPlan:
    def __init__(self, *, world_size, hidden_dim, max_tok_per_rank, num_expert_per_rank, num_expert_per_token,
                 max_recv, dtype, use_weights=True, block_num=None, warp_per_block=None, arena=None,
                 region_names=None) -> None:
        CALL_LOG.append(("v2.EpDispatchPlan", dict(world_size=world_size, hidden_dim=hidden_dim, dtype=dtype)))
        self.scale_bytes = 0


class EpDispatchPlan593(EpDispatchPlan):
    def __init__(self, *, scale_bytes: int = 0, **kw) -> None:
        super().__init__(**kw)
        if scale_bytes % 4:
            raise ValueError(f"scale_bytes={scale_bytes} must be a whole number of dwords")
        self.scale_bytes = scale_bytes
