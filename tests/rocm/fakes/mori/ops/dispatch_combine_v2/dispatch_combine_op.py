"""Fake mori.ops.dispatch_combine_v2.dispatch_combine_op: the config as 624002c8 and #593 both have it
(python/mori/ops/dispatch_combine_v2/dispatch_combine_op.py:85-88, ``scale_dim`` / ``scale_type_size``
"forwarded verbatim"; no ``scale_stride_bytes``) and the op, which hands the config to the HIP backend."""

from dataclasses import dataclass

import torch

from ... import CALL_LOG


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


class EpDispatchCombineOp:
    """The op layer: the HIP backend's gate decides (hip_backend.EpDispatchCombineOpHip)."""

    def __init__(self, config, communicator=None) -> None:
        from . import hip_backend

        CALL_LOG.append(("v2.EpDispatchCombineOp", config))
        self.backend = hip_backend.EpDispatchCombineOpHip(config, communicator)
        self.config = config
