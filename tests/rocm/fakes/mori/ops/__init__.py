"""Fake mori.ops: EpDispatchCombineConfig / KernelType / Op with the 1.2.4 signatures.

Field order and defaults of the config, the quant_type names and their error, the dtype table,
the int32 index dtype, the returned tuples and their shapes, and combine's "indices must be this
rank's own routing" check are copied as facts from mori/ops/dispatch_combine.py (1.2.4), and the
blockwise combine's kernel-type check from ROCm/mori 624002c8 dispatch_combine.py:1485-1506
(fp8_blockwise runs on IntraNode / IntraNodeLL / AsyncLL only, a ValueError at the first combine).
Data movement: ranks of one world share a fabric; each collective call waits on a barrier,
so multi-rank tests run one thread per rank.
"""

from __future__ import annotations

import enum
import os
import threading
from dataclasses import dataclass

import torch

from .. import CALL_LOG

TOPK_IDX_DTYPE = torch.int32
_DTYPE_SUFFIX = {
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8_ocp",
    torch.float8_e4m3fnuz: "fp8_fnuz",
    torch.float4_e2m1fn_x2: "fp4",
}
_QUANT_TYPES = ("none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise")
_BLOCKWISE_KERNELS = {"fp8_blockwise": ("IntraNode", "IntraNodeLL", "AsyncLL"), "fp4_blockwise": ("IntraNode", "IntraNodeLL")}


class EpDispatchCombineKernelType(enum.Enum):
    IntraNode = 0
    InterNode = 1
    InterNodeV1 = 2
    InterNodeV1LL = 3
    AsyncLL = 4
    IntraNodeLL = 5

    def __str__(self) -> str:
        return self.name


def _normalize_quant_type(quant_type):
    if isinstance(quant_type, str) and quant_type.strip().lower() in _QUANT_TYPES:
        return quant_type.strip().lower()
    raise ValueError(f"invalid quant_type '{quant_type}', expected one of {list(_QUANT_TYPES)}")


@dataclass
class EpDispatchCombineConfig:
    data_type: torch.dtype
    rank: int
    world_size: int
    hidden_dim: int
    scale_dim: int
    scale_type_size: int
    max_token_type_size: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    warp_num_per_block: int = 8
    block_num: int = 80
    max_total_recv_tokens: int = 0
    use_external_inp_buf: bool = True
    kernel_type: EpDispatchCombineKernelType = EpDispatchCombineKernelType.IntraNode
    gpu_per_node: int = 8
    rdma_block_num: int = 0
    num_qp_per_pe: int = 1
    quant_type: str = "none"


class _Fabric:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots: list = [None] * world_size


_FABRICS: dict = {}
_FABRIC_LOCK = threading.Lock()


def _fabric(world_size: int, generation: object) -> _Fabric:
    with _FABRIC_LOCK:
        key = (world_size, generation)
        if key not in _FABRICS:
            _FABRICS[key] = _Fabric(world_size)
        return _FABRICS[key]


def _zeros(shape, dtype):
    if dtype.itemsize == 1 and dtype not in (torch.uint8, torch.int8):
        return torch.zeros(shape, dtype=torch.uint8).view(dtype)
    return torch.zeros(shape, dtype=dtype)


class EpDispatchCombineOp:
    FABRIC_GENERATION: object = "default"  # tests bump it to isolate worlds

    def __init__(self, config: EpDispatchCombineConfig) -> None:
        CALL_LOG.append(("EpDispatchCombineOp", config))
        _normalize_quant_type(config.quant_type)
        if not isinstance(config.kernel_type, EpDispatchCombineKernelType):
            raise TypeError(f"kernel_type must be EpDispatchCombineKernelType, got {config.kernel_type!r}")
        if config.gpu_per_node & (config.gpu_per_node - 1) or config.world_size % config.gpu_per_node:
            raise AssertionError("IsPowerOf2(gpuPerNode) && worldSize % gpuPerNode == 0")
        self.config = config
        self.combine_scale_dim = int(os.environ.get("MORI_FP8_COMBINE_SCALE_DIM", "56"))
        self.calls: list = []
        self._fabric = _fabric(config.world_size, self.FABRIC_GENERATION)
        self._cur_tokens = 0
        self._recv_from: list = []  # (src rank, src token) of each received slot

    def max_num_tokens_to_recv(self) -> int:
        c = self.config
        return c.world_size * c.max_num_inp_token_per_rank if not c.max_total_recv_tokens else c.max_total_recv_tokens

    def dispatch(self, input, weights, scales, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                 call_local_expert_count=False, *, routing=None, return_routing=False):
        c = self.config
        self.calls.append(("dispatch", dict(input=input, weights=weights, scales=scales, indices=indices)))
        if input.dtype not in _DTYPE_SUFFIX:
            raise KeyError(input.dtype)
        if indices.dtype != TOPK_IDX_DTYPE:
            raise TypeError(f"fake mori: indices must be {TOPK_IDX_DTYPE}, got {indices.dtype}")
        if weights is not None and weights.dtype != torch.float32:
            raise TypeError(f"fake mori: weights must be float32, got {weights.dtype}")
        if input.size(0) > c.max_num_inp_token_per_rank:
            raise AssertionError("more tokens than max_num_inp_token_per_rank")
        if input.size(1) * input.dtype.itemsize > c.hidden_dim * c.max_token_type_size:
            raise AssertionError("token does not fit mori's staging (hidden_dim * max_token_type_size)")
        has_scales = scales is not None and c.scale_dim > 0
        if has_scales and tuple(scales.shape) != (input.size(0), c.scale_dim):
            raise AssertionError(f"scales must be [tokens, scale_dim={c.scale_dim}], got {tuple(scales.shape)}")
        self._cur_tokens = int(input.size(0))
        fab = self._fabric
        fab.slots[c.rank] = (input, weights, scales if has_scales else None, indices)
        fab.barrier.wait()
        max_recv = self.max_num_tokens_to_recv()
        k = c.num_experts_per_token
        out = _zeros((max_recv, input.size(1)), input.dtype)
        out_w = torch.zeros(max_recv, k, dtype=torch.float32)
        out_s = torch.zeros(max_recv, c.scale_dim, dtype=scales.dtype) if has_scales else None
        out_i = torch.zeros(max_recv, k, dtype=TOPK_IDX_DTYPE)
        self._recv_from = []
        n = 0
        for src in range(c.world_size):
            s_in, s_w, s_s, s_i = fab.slots[src]
            dest = s_i.to(torch.int64) // c.num_experts_per_rank
            for t in range(s_in.size(0)):
                if bool((dest[t] == c.rank).any()):
                    out.view(torch.uint8)[n] = s_in[t].view(torch.uint8)
                    if s_w is not None:
                        out_w[n] = s_w[t]
                    if out_s is not None:
                        out_s[n] = s_s[t]
                    out_i[n] = s_i[t]
                    self._recv_from.append((src, t))
                    n += 1
        fab.barrier.wait()
        total = torch.tensor([n], dtype=TOPK_IDX_DTYPE)
        return (out, out_w, out_s, out_i, total)

    def _combine_quant(self, rows: torch.Tensor) -> torch.Tensor:
        """Blockwise fp8 with fp32 scales, block = hidden / MORI_FP8_COMBINE_SCALE_DIM (what mori does in-kernel)."""
        if _normalize_quant_type(self.config.quant_type) != "fp8_blockwise":
            return rows.float()
        h = rows.shape[1]
        block = h // self.combine_scale_dim
        x = rows.float().view(rows.shape[0], self.combine_scale_dim, block)
        scale = x.abs().amax(dim=2, keepdim=True).clamp(min=1e-30) / 448.0
        q = (x / scale).to(torch.float8_e4m3fn).float() * scale
        return q.view(rows.shape[0], h)

    def combine(self, input, weights, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                use_external_inp_buf=-1, call_reset=False, *, routing=None):
        c = self.config
        self.calls.append(("combine", dict(input=input, weights=weights, indices=indices)))
        if int(indices.size(0)) != self._cur_tokens:
            raise ValueError(
                f"combine() indices has {int(indices.size(0))} rows but this rank dispatched {self._cur_tokens} "
                "tokens. Pass this rank's own [num_tokens, topk] routing (ROCm/mori#475)."
            )
        if input.dtype not in _DTYPE_SUFFIX:
            raise KeyError(input.dtype)
        quant = _normalize_quant_type(c.quant_type)
        if quant in _BLOCKWISE_KERNELS and c.kernel_type.name not in _BLOCKWISE_KERNELS[quant]:
            raise ValueError(f"{quant} combine currently only supports {'/'.join(_BLOCKWISE_KERNELS[quant])} combine")
        fab = self._fabric
        fab.slots[c.rank] = (self._combine_quant(input), list(self._recv_from))
        fab.barrier.wait()
        out = torch.zeros(c.max_num_inp_token_per_rank, input.size(1), dtype=torch.float32)
        for dst in range(c.world_size):
            rows, recv_from = fab.slots[dst]
            for slot, (src, t) in enumerate(recv_from):
                if src == c.rank:
                    out[t] += rows[slot]
        fab.barrier.wait()
        return (out.to(input.dtype), None)
