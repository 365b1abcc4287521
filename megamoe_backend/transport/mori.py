"""mori transport: MegaMoE dispatch / combine over AMD mori's EpDispatchCombineOp (v1 API).

    [wire rows] -> split payload | E8M0 scales -> mori dispatch (one row per token per destination
    rank) -> rejoin rows, local slots -> experts -> sum a row's local pairs -> mori combine (sums
    the ranks' partial rows in-kernel) -> [tokens, H]

Argument facts (amd-mori 1.2.4 wheel, python/mori/ops/dispatch_combine.py; docs/rocm.md):
- ``EpDispatchCombineConfig(data_type, rank, world_size, hidden_dim, scale_dim, scale_type_size,
  max_token_type_size, max_num_inp_token_per_rank, num_experts_per_rank, num_experts_per_token,
  ..., kernel_type, gpu_per_node, ..., quant_type)``; ``quant_type`` quantises the *combine*
  (none | fp8_direct_cast | fp8_blockwise | fp4_blockwise); dispatch ships whatever dtype the input
  tensor has, with caller-made scales (``scale_dim`` per token, ``scale_type_size`` bytes each).
- ``dispatch(input, weights, scales, indices)`` -> ``(out, out_weights, out_scales, out_indices,
  total_recv)``; indices int32 global expert ids, rank = id // num_experts_per_rank; weights fp32.
- ``combine(input, weights, indices)`` -> ``(out, out_weights)``; ``indices`` is this rank's own
  [T, k] routing (the tensor given to dispatch), out is [max_num_inp_token_per_rank, hidden].

Not run on AMD hardware: CPU CI checks every argument against fakes shaped like that wheel.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..formats import MX_BLOCK
from ..knobs import KnobError
from ..platform.rocm_rules import check_mori_combine_kernel
from ..platform.topology import EpTopology, gather_ep_topology
from .base import DispatchHandle, DispatchResult, PeerInputError, Transport, TransportError
from .bound_header import bound_disagreement
from .layout import DispatchLayout

logger = logging.getLogger("megamoe")

COMBINE_SCALE_DIM_ENV = "MORI_FP8_COMBINE_SCALE_DIM"  # read by mori's C++ handle at construction

# Our dispatch wire -> (torch dtype of the payload mori moves, payload columns per hidden element)
_DISPATCH_DTYPES = {
    "bf16": (torch.bfloat16, 1),
    "fp8": (torch.float8_e4m3fn, 1),  # OCP e4m3, what gfx950/gfx1250 and aiter's a8w4 use
    "fp4": (torch.float4_e2m1fn_x2, 2),  # two e2m1 per byte, first element in the low nibble
}
_COMBINE_QUANT = {"bf16": "none", "fp8_blockwise_1x32": "fp8_blockwise"}


@dataclass(frozen=True)
class MoriWire:
    """Everything the wire knobs decide in mori's config; pure, so CPU tests can check it."""

    dispatch_wire: str
    combine_wire: str
    hidden: int
    data_type: torch.dtype  # config.data_type: the dispatch payload dtype
    payload_cols: int  # columns of the dispatch input tensor (hidden, or hidden // 2 for fp4)
    scale_dim: int  # E8M0 scales per token (0: bf16 wire)
    scale_type_size: int  # bytes per scale
    max_token_type_size: int  # widest element either direction moves (bf16 combine: 2)
    config_hidden_dim: int  # sizes mori's staging: max(dispatch cols, combine cols)
    quant_type: str  # mori's combine quantisation
    combine_scale_dim: int | None = None  # MORI_FP8_COMBINE_SCALE_DIM for 1x32 combine blocks

    @classmethod
    def from_knobs(cls, dispatch_wire: str, combine_wire: str, hidden: int) -> "MoriWire":
        if dispatch_wire not in _DISPATCH_DTYPES:
            raise KnobError(f"MEGA_DISPATCH_WIRE={dispatch_wire!r}; mori carries bf16 | fp8 | fp4")
        if combine_wire not in _COMBINE_QUANT:
            raise KnobError(f"MEGA_COMBINE_WIRE={combine_wire!r}; mori carries bf16 | fp8_blockwise_1x32")
        dtype, packing = _DISPATCH_DTYPES[dispatch_wire]
        quantised = dispatch_wire != "bf16"
        if (quantised or combine_wire != "bf16") and hidden % MX_BLOCK:
            raise KnobError(f"hidden={hidden} is not a multiple of {MX_BLOCK}; quantised mori wires need whole 1x32 blocks")
        if combine_wire != "bf16" and quantised:
            raise KnobError(
                f"MEGA_COMBINE_WIRE={combine_wire} with MEGA_DISPATCH_WIRE={dispatch_wire}: mori's blockwise combine "
                "requires bf16 dispatch and combine dtypes (amd-mori 1.2.4); use one bf16 side"
            )
        return cls(
            dispatch_wire=dispatch_wire,
            combine_wire=combine_wire,
            hidden=hidden,
            data_type=dtype,
            payload_cols=hidden // packing,
            scale_dim=hidden // MX_BLOCK if quantised else 0,
            scale_type_size=1,  # E8M0: one byte per 1x32 block
            max_token_type_size=torch.bfloat16.itemsize,  # combine moves bf16 rows
            config_hidden_dim=hidden,
            quant_type=_COMBINE_QUANT[combine_wire],
            combine_scale_dim=hidden // MX_BLOCK if combine_wire != "bf16" else None,
        )

    @property
    def payload_bytes(self) -> int:
        return self.payload_cols * self.data_type.itemsize

    @property
    def row_bytes(self) -> int:
        return self.payload_bytes + self.scale_dim * self.scale_type_size


def apply_combine_scale_env(wire: MoriWire, env: dict | None = None) -> None:
    """mori reads its blockwise-combine block count from the environment, at op construction.

    1x32 blocks need ``MORI_FP8_COMBINE_SCALE_DIM = hidden // 32`` (mori's default 56 gives 1x128
    at hidden 7168). A different value already set is a contradiction, not something to override.
    """
    if wire.combine_scale_dim is None:
        return
    env = os.environ if env is None else env
    want = str(wire.combine_scale_dim)
    have = env.get(COMBINE_SCALE_DIM_ENV)
    if have is not None and have.strip() != want:
        raise KnobError(
            f"MEGA_COMBINE_WIRE={wire.combine_wire} needs {COMBINE_SCALE_DIM_ENV}={want} (hidden {wire.hidden} / 32) "
            f"but it is set to {have!r}; unset it or set it to {want}"
        )
    env[COMBINE_SCALE_DIM_ENV] = want


# Multi-node kernel choice and launch geometry as vLLM 0.34's MoriAll2AllManager._make_all2all_kwargs
# picks them for ``--all2all-backend mori`` (vllm/distributed/device_communicators/all2all.py:989-1020):
# IntraNode unless the EP group spans nodes (``if not self.internode``), then InterNodeV1LL while the
# per-rank token budget is at most VLLM_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD (default 256,
# vllm/envs.py:306; vLLM's test_inter_node_switch: "<= threshold -> LL"), InterNodeV1 above; warps per
# block / blocks / RDMA blocks per arch. The threshold is read from the same variable, so one setting
# steers vLLM's mori all2all and this transport alike.
INTER_LL_MAX_TOKENS = 256
INTER_LL_THRESHOLD_ENV = "VLLM_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD"
MAX_GPUS_PER_NODE = 8  # vLLM: gpu_per_node=min(8, num_ep_ranks)
_INTRANODE_LAUNCH = (16, 80, 0)  # all2all.py:990-995
_INTERNODE_LAUNCH = {"gfx942": (16, 32, 16), "gfx950": (8, 64, 32)}  # all2all.py:1010-1017


@dataclass(frozen=True)
class MoriKernel:
    """EpDispatchCombineKernelType name, gpu_per_node and the launch geometry passed to mori's config
    (None: mori's own default, for an arch vLLM has no numbers for)."""

    kernel_type: str
    gpu_per_node: int
    warp_num_per_block: int | None = None
    block_num: int | None = None
    rdma_block_num: int | None = None

    def config_fields(self) -> dict:
        launch = dict(warp_num_per_block=self.warp_num_per_block, block_num=self.block_num, rdma_block_num=self.rdma_block_num)
        return {k: v for k, v in launch.items() if v is not None}


def inter_ll_max_tokens(env: Mapping[str, str] | None = None) -> int:
    """VLLM_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD as vLLM reads it (an int, default 256); a value
    it would not read as one is an error naming the variable, not a silent default."""
    raw = (os.environ if env is None else env).get(INTER_LL_THRESHOLD_ENV)
    if raw is None or raw.strip() == "":
        return INTER_LL_MAX_TOKENS
    try:
        return int(raw)
    except ValueError:
        raise KnobError(f"{INTER_LL_THRESHOLD_ENV}={raw!r}: vLLM reads an integer token count (default "
                        f"{INTER_LL_MAX_TOKENS}); set it to e.g. 256 or unset it") from None


def ep_ranks_per_node(ep_size: int, topology: EpTopology) -> int:
    """mori's ``gpu_per_node`` for this EP group, from where its ranks run, not from how many GPUs this
    process sees (one visible GPU per process would read as one GPU per node and pick the RDMA kernels
    on a single host). One host: ``min(8, ep_size)`` as vLLM passes it; several: the ranks on each
    host, which mori needs equal (it asserts worldSize % gpuPerNode == 0)."""
    if topology.one_host:
        return min(MAX_GPUS_PER_NODE, ep_size)
    per_host = [sum(r.host == h for r in topology.ranks) for h in topology.hosts]
    if len(set(per_host)) != 1:
        raise TransportError(f"mori needs the same number of EP ranks on every node; {topology.describe()} puts "
                             f"{per_host} on its hosts: place the EP ranks evenly")
    return per_host[0]


def pick_kernel(ep_size: int, gpus_per_node: int, mtpr: int, gfx_arch: str | None = None,
                ll_max_tokens: int = INTER_LL_MAX_TOKENS) -> MoriKernel:
    """One node -> IntraNode; across nodes InterNodeV1LL for token budgets <= ``ll_max_tokens``
    (inter_ll_max_tokens), else InterNodeV1. ``gpus_per_node``: EP ranks per node (ep_ranks_per_node)."""
    if gpus_per_node <= 0 or gpus_per_node & (gpus_per_node - 1):
        raise TransportError(f"mori needs a power-of-two gpu_per_node, got {gpus_per_node}")
    per_node = min(ep_size, gpus_per_node)
    if ep_size % per_node:
        raise TransportError(f"EP size {ep_size} is not a multiple of gpu_per_node {per_node} (mori asserts it)")
    if ep_size <= gpus_per_node:
        return MoriKernel("IntraNode", per_node, *_INTRANODE_LAUNCH)
    kind = "InterNodeV1LL" if mtpr <= ll_max_tokens else "InterNodeV1"
    return MoriKernel(kind, per_node, *_INTERNODE_LAUNCH.get(gfx_arch or "", (None, None, None)))


def pick_kernel_type(ep_size: int, gpus_per_node: int, mtpr: int | None = None) -> tuple[str, int]:
    """(EpDispatchCombineKernelType name, gpu_per_node); without ``mtpr`` the high-throughput choice."""
    kernel = pick_kernel(ep_size, gpus_per_node, INTER_LL_MAX_TOKENS + 1 if mtpr is None else mtpr)
    return kernel.kernel_type, kernel.gpu_per_node


def _gfx_arch(device: torch.device) -> str | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return str(getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")).split(":")[0] or None


_SHMEM_STATE: dict[str, Any] = {}  # the EP group this process's mori shmem serves (one per process)
_SHMEM_LOCK = threading.Lock()  # check-and-init is one step when layers are built from several threads


def broadcast_from_group_root(obj: Any, group: Any, dist: Any = None) -> Any:
    """``obj`` from the group's first rank, on every rank of ``group``.

    Why not ``src=0``: torch's ``src`` is a global rank, and global rank 0 is not a member of an EP
    group that leaves it out (mori.shmem.shmem_torch_process_group_init broadcasts from 0,
    python/mori/shmem/api.py:113-119, and fails there). ATOM's cco bootstrap does the same.
    """
    if dist is None:
        import torch.distributed as dist
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def shmem_initialised(shmem: Any) -> bool:
    """Whether mori shmem already runs in this process (vLLM's MoriAll2AllManager starts it, for one).

    mori 1.2.x / 624002c8 has no Python query (ShmemIsInitialized is C++ only, shmem_api.hpp:82,
    and shmem_mype() before init dereferences a null pointer, runtime.cpp:172). Every init path
    records the GPU it loaded the shmem module on in ``api._shmem_module_loaded_gpus`` (api.py:34,
    79) and shmem_finalize drops it (api.py:175): read, never written. A public query wins.
    """
    query = getattr(shmem, "shmem_is_initialized", None)
    if callable(query):
        return bool(query())
    return bool(getattr(getattr(shmem, "api", None), "_shmem_module_loaded_gpus", None))


def init_mori_shmem(group: Any, rank: int, world_size: int, shmem: Any = None, dist: Any = None) -> str:
    """Start mori shmem on the EP group, or reuse the one already running on the same ranks.

    Bootstrap as mori's own ``shmem_torch_process_group_init`` does it (unique id from the root,
    ``shmem_init_attr``), but rooted at the group's first rank. mori skips a second init silently
    (init.cpp:669-674), so an engine's earlier init on another group would leave MegaMoE on the
    engine's world: whoever started it, the shmem world must be this EP group (mype / npes).
    Returns "initialised" or "reused".
    """
    with _SHMEM_LOCK:
        done = _SHMEM_STATE.get("group")
        if done is not None:
            if done is not group:
                raise TransportError("mori shmem is already initialised on another process group; one EP group per process")
            return _SHMEM_STATE["origin"]
        origin = _start_or_reuse_shmem(group, rank, world_size, shmem, dist)
        _SHMEM_STATE.update(group=group, origin=origin)
        return origin


def _start_or_reuse_shmem(group: Any, rank: int, world_size: int, shmem: Any, dist: Any) -> str:
    if shmem is None:
        shmem = importlib.import_module("mori.shmem")
    origin = "reused" if shmem_initialised(shmem) else "initialised"
    if origin == "initialised":
        uid = broadcast_from_group_root(shmem.shmem_get_unique_id() if rank == 0 else None, group, dist)
        status = shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, world_size, uid)
        if status not in (None, 0):
            raise TransportError(f"mori.shmem.shmem_init_attr(rank={rank}, nranks={world_size}) returned {status}")
    pe, npes = int(shmem.shmem_mype()), int(shmem.shmem_npes())
    if (pe, npes) != (rank, world_size):
        raise TransportError(
            f"mori shmem in this process runs on {npes} PEs with this rank as PE {pe}, but MegaMoE's EP group has "
            f"{world_size} ranks with this one as rank {rank}: mori shmem is process-wide and was started on another "
            "group (by the engine, e.g. vLLM --all2all-backend mori_*); run MegaMoE on that group or leave mori to it"
        )
    logger.info("[megamoe] mori shmem %s on the EP group (PE %d of %d)", origin, pe, npes)
    return origin


def reset_mori_shmem_state() -> None:
    """Forget the initialised group (tests; mori.shmem.shmem_finalize on teardown)."""
    _SHMEM_STATE.clear()


@dataclass
class MoriDispatchHandle(DispatchHandle):
    """What combine needs back: this rank's own mori routing and where received rows came from."""

    mori_ids: torch.Tensor | None = None  # int32 [T, k] given to dispatch
    num_tokens: int = 0
    num_received: int = 0
    pair_row: torch.Tensor | None = None  # received row of each received pair (pair order)
    extra: dict = field(default_factory=dict)


def mori_routing(layout: DispatchLayout, experts_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layout -> (int32 ids [T, k] in mori's space rank * epr + slot, fp32 weights [T, k]).

    A masked entry (-1) becomes a copy of the token's first valid id with weight 0: mori sends a
    token once per rank, so the copy adds no traffic, and the receiver drops repeated ids.
    A fully masked token is addressed to local expert 0 of rank 0 with weight 0.
    """
    t, k = layout.num_tokens, layout.topk
    device = layout.send_token.device
    ids = torch.full((t, k), -1, dtype=torch.int64, device=device)
    weights = torch.zeros((t, k), dtype=torch.float32, device=device)
    row_rank = torch.repeat_interleave(torch.arange(layout.ep_size, device=device), layout.send_rank_counts)
    valid = layout.send_slots >= 0
    s_idx, k_idx = torch.nonzero(valid, as_tuple=True)
    tok = layout.send_token[s_idx]
    ids[tok, k_idx] = row_rank[s_idx] * experts_per_rank + layout.send_slots[s_idx, k_idx].to(torch.int64)
    weights[tok, k_idx] = layout.send_weights[s_idx, k_idx]
    masked = ids < 0
    if bool(masked.any()):
        first = torch.where(masked, torch.full_like(ids, torch.iinfo(torch.int64).max), ids).min(dim=1).values
        first = torch.where(first == torch.iinfo(torch.int64).max, torch.zeros_like(first), first)
        ids = torch.where(masked, first.unsqueeze(1).expand_as(ids), ids)
    return ids.to(torch.int32).contiguous(), weights.contiguous()


def local_slots(recv_ids: torch.Tensor, recv_weights: torch.Tensor, rank: int, experts_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Received mori ids/weights -> (int32 local slot or -1, fp32 weight or 0), repeats dropped.

    A repeated id is one expert: its first occurrence runs, with the weight of all occurrences. The
    sender's copies of masked entries carry weight 0 and may stand before the real entry (a masked
    k = 0 is a copy of a later id), so keeping the first occurrence's own weight would drop the real
    one (an H200 run of the mori device forward found it: 10 % masked routes, rows off by 0.9)."""
    ids = recv_ids.to(torch.int64)
    lo = rank * experts_per_rank
    here = (ids >= lo) & (ids < lo + experts_per_rank)
    w = recv_weights.to(torch.float32)
    k = ids.shape[1]
    if k > 1:
        same = ids.unsqueeze(2) == ids.unsqueeze(1)  # [R, k, k]
        here = here & ~same.tril(diagonal=-1).any(dim=2)
        w = (same.to(torch.float32) * w.unsqueeze(1)).sum(dim=2)  # each entry: its expert's whole weight
    slots = torch.where(here, ids - lo, torch.full_like(ids, -1)).to(torch.int32)
    weights = torch.where(here, w, torch.zeros((), dtype=torch.float32, device=ids.device))
    return slots, weights


def live_local_slots(recv_ids: torch.Tensor, recv_weights: torch.Tensor, total_recv: torch.Tensor, rank: int,
                     experts_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``local_slots`` over mori's whole receive buffer, rows past ``total_recv`` (a device count)
    dead (-1 / 0): what mori left there is a stale step's. Device ops, shapes fixed by the buffer."""
    slots, weights = local_slots(recv_ids, recv_weights, rank, experts_per_rank)
    live = (torch.arange(recv_ids.shape[0], device=recv_ids.device) < total_recv.reshape(-1)[:1].to(torch.int64)).unsqueeze(1)
    return torch.where(live, slots, torch.full_like(slots, -1)), torch.where(live, weights, torch.zeros_like(weights))


class MoriTransport(Transport):
    """Core Transport over mori's EpDispatchCombineOp. Built by transport.registry as (plan, group, device).

    mori's combine sums each token's rows from all ranks in-kernel, so ``reduces_in_combine`` is
    True: ``combine_reduced`` returns [T, H] sums. ``combine`` keeps the core's pair-row contract for
    the bf16 combine wire by returning each token's sum in its first pair row.

    ``dispatch`` / ``combine`` serve the eager torch forward (the torch experts, an injected
    transport): they read counts on the host. The Triton experts take the sync-free mori forward
    (layer/forwards/mori.py), which calls ``op`` itself with ``live_local_slots``.
    """

    name = "mori"
    reduces_in_combine = True

    def __init__(
        self,
        plan: Any,
        group: Any,
        device: torch.device,
        *,
        gpus_per_node: int | None = None,
        topology: EpTopology | None = None,
        dist: Any = None,
        mori_module: Any = None,
        all_reduce_max: Callable[[int], int] | None = None,
        gfx_arch: str | None = None,
    ) -> None:
        mori = mori_module or importlib.import_module("mori")
        self.plan = plan
        self.group = group
        self.device = torch.device(device)
        self.rank, self.ep_size = plan.ep_rank, plan.ep_size
        counts = {plan.placement.num_local(r) for r in range(self.ep_size)}
        if len(counts) != 1:
            raise KnobError(f"mori needs the same expert count on every rank, placement has {sorted(counts)}")
        self.experts_per_rank = counts.pop()
        self.wire = MoriWire.from_knobs(plan.dispatch.name, plan.combine.name, plan.hidden)
        if gpus_per_node is None:  # where the ranks run (a collective: every EP rank builds its transport)
            gpus_per_node = ep_ranks_per_node(self.ep_size, topology or gather_ep_topology(group, self.device))
        self.kernel = pick_kernel(self.ep_size, gpus_per_node, plan.mtpr, gfx_arch or _gfx_arch(self.device),
                                  inter_ll_max_tokens())
        kernel_name, per_node = self.kernel.kernel_type, self.kernel.gpu_per_node
        check_mori_combine_kernel(self.wire.combine_wire, kernel_name)
        self.shmem_origin = init_mori_shmem(group, self.rank, self.ep_size, shmem=getattr(mori, "shmem", None), dist=dist)
        apply_combine_scale_env(self.wire)
        ops = mori.ops
        w = self.wire
        self.config = ops.EpDispatchCombineConfig(
            data_type=w.data_type,
            rank=self.rank,
            world_size=self.ep_size,
            hidden_dim=w.config_hidden_dim,
            scale_dim=w.scale_dim,
            scale_type_size=w.scale_type_size,
            max_token_type_size=w.max_token_type_size,
            max_num_inp_token_per_rank=plan.mtpr,
            num_experts_per_rank=self.experts_per_rank,
            num_experts_per_token=plan.topk,
            kernel_type=getattr(ops.EpDispatchCombineKernelType, kernel_name),
            gpu_per_node=per_node,
            quant_type=w.quant_type,
            **self.kernel.config_fields(),
        )
        self.op = ops.EpDispatchCombineOp(self.config)
        self._all_reduce_max = all_reduce_max or self._torch_all_reduce_max
        logger.info(
            "[megamoe] mori transport: dispatch=mori kernel_type=%s gpu_per_node=%d wire=%s (data_type=%s scale_dim=%d) "
            "combine=%s (quant_type=%s) mtpr=%d",
            kernel_name, per_node, w.dispatch_wire, w.data_type, w.scale_dim, w.combine_wire, w.quant_type, plan.mtpr,
        )

    @property
    def recv_capacity(self) -> int:
        """Rows of mori's dispatch output: max_total_recv_tokens, or world_size x max_num_inp_token_per_rank."""
        c = self.config
        return int(getattr(c, "max_total_recv_tokens", 0) or c.world_size * c.max_num_inp_token_per_rank)

    def _torch_all_reduce_max(self, status: int) -> int:
        import torch.distributed as dist

        if self.group is None or self.ep_size == 1:
            return status
        t = torch.tensor([status], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def dispatch(self, token_rows: torch.Tensor, layout: DispatchLayout, status: int = 0, bound: int = 0) -> DispatchResult:
        # mori has no status word: one small all-reduce makes bad input on any rank an error on all.
        if self._all_reduce_max(int(status)):
            raise PeerInputError("[megamoe] dispatch refused on every rank because one rank reported bad input")
        # ... and two more for the token bound: every rank sees the same (max, min), so all refuse alike
        highest, lowest = self._all_reduce_max(int(bound)), -self._all_reduce_max(-int(bound))
        if highest != lowest:
            detail = bound_disagreement([lowest, highest], ("lowest", "highest"))
            raise PeerInputError(f"[megamoe] dispatch refused on every rank: {detail}")
        w = self.wire
        t = layout.num_tokens
        if t > self.plan.mtpr:
            raise PeerInputError(f"[megamoe] {t} tokens exceed MEGA_MAX_TOKENS_PER_RANK={self.plan.mtpr} (mori's max_num_inp_token_per_rank)")
        if token_rows.shape[1] != w.row_bytes:
            raise ValueError(f"wire rows have {token_rows.shape[1]} bytes, the {w.dispatch_wire} wire needs {w.row_bytes}")
        payload = token_rows[:, : w.payload_bytes].contiguous().view(w.data_type)
        scales = token_rows[:, w.payload_bytes :].contiguous() if w.scale_dim else None
        ids, weights = mori_routing(layout, self.experts_per_rank)
        out, out_weights, out_scales, out_indices, total_recv = self.op.dispatch(payload, weights, scales, ids)
        received = int(total_recv.reshape(-1)[0].item())
        rows = out[:received].contiguous().view(torch.uint8)
        if w.scale_dim:
            rows = torch.cat((rows, out_scales[:received].contiguous().view(torch.uint8)), dim=1)
        slots, recv_weights = local_slots(out_indices[:received], out_weights[:received], self.rank, self.experts_per_rank)
        pair_row = torch.nonzero(slots >= 0, as_tuple=True)[0]
        handle = MoriDispatchHandle(
            layout=layout, recv_rank_counts=[], recv_pair_counts=[],
            mori_ids=ids, num_tokens=t, num_received=received, pair_row=pair_row,
        )
        return DispatchResult(rows=rows, slots=slots, weights=recv_weights, handle=handle)

    def combine_reduced(self, pair_values: torch.Tensor, handle: MoriDispatchHandle) -> torch.Tensor:
        """fp32 route-weighted pair rows (received-pair order) -> fp32 [T, H] token sums."""
        hidden = self.wire.hidden
        max_recv = max(handle.num_received, 1)
        partial = torch.zeros(max_recv, hidden, dtype=torch.float32, device=pair_values.device)
        partial.index_add_(0, handle.pair_row, pair_values.to(torch.float32))
        out, _ = self.op.combine(partial.to(torch.bfloat16), None, handle.mori_ids)
        return out[: handle.num_tokens].to(torch.float32)

    def combine(self, pair_rows: torch.Tensor, handle: MoriDispatchHandle) -> torch.Tensor:
        """Core contract (pair rows back in layout pair order), for the bf16 combine wire only."""
        if self.wire.combine_wire != "bf16":
            raise TransportError(
                "mori quantises the combine in-kernel (quant_type fp8_blockwise): the layer must call "
                "combine_reduced() with fp32 rows, not pre-quantised wire rows (see reduces_in_combine)"
            )
        values = pair_rows.view(torch.bfloat16).to(torch.float32)
        sums = self.combine_reduced(values, handle)
        tokens = handle.layout.pair_token
        n = tokens.shape[0]
        first = torch.full((handle.num_tokens,), n, dtype=torch.int64, device=tokens.device)
        first = first.scatter_reduce(0, tokens, torch.arange(n, device=tokens.device), reduce="amin")
        has_pair = first < n
        back = torch.zeros(n, self.wire.hidden, dtype=torch.float32, device=sums.device)
        back[first[has_pair]] = sums[has_pair]
        return back.to(torch.bfloat16).view(torch.uint8)
