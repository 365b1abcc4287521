"""Fake mori.ops.dispatch_combine_v2 (mori EPv2), as far as MegaMoE asks it one thing: can its
dispatch carry a per-token scale row?

ROCm/mori 624002c8 (2026-08-21): ``EpDispatchCombineConfig`` has ``scale_dim`` / ``scale_type_size``
(python/mori/ops/dispatch_combine_v2/dispatch_combine_op.py:86-88), but the HIP backend refuses
them: ``if cfg.scale_dim and cfg.scale_type_size: bad.append("per-token scales forwarding")``
(hip_backend.py:176-177), so an op built with a scale row raises at construction. ROCm/mori#593
(merged 2026-08-24, "forward a per-token scale row with dispatch") lays the row down at mori's own
stride, padded to 128 B (``EpScaleStride``), which the config reports as ``scale_stride_bytes``.
``EpDispatchCombineConfig`` is the 624002c8 shape; ``EpDispatchCombineConfigScaleRow`` the #593 one
(tests rebind the name). ``EpDispatchCombineOp`` raises as the HIP backend does.
"""

from dataclasses import dataclass

import torch

from .. import CALL_LOG


@dataclass
class EpDispatchCombineConfig:
    rank: int
    world_size: int
    hidden_dim: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    data_type: torch.dtype = torch.bfloat16
    dispatch_data_type: torch.dtype = None
    combine_data_type: torch.dtype = None
    scale_dim: int = 0
    scale_type_size: int = 0
    combine_mode: str = "gather"
    quant_type: str = "none"


@dataclass
class EpDispatchCombineConfigScaleRow(EpDispatchCombineConfig):
    @property
    def scale_stride_bytes(self) -> int:
        """The row mori lays down: the caller's scale bytes padded to 128 B (ROCm/mori#593)."""
        return -(-self.scale_dim * self.scale_type_size // 128) * 128


class EpDispatchCombineOp:
    def __init__(self, config, communicator=None) -> None:
        CALL_LOG.append(("v2.EpDispatchCombineOp", config))
        if config.scale_dim and config.scale_type_size and not hasattr(config, "scale_stride_bytes"):
            raise RuntimeError("MORI EPv2 hip backend does not support: per-token scales forwarding")
        self.config = config
