"""MegaMoELayer: route-weighted MoE over expert-parallel ranks.

    [tokens] -> quantise once (dispatch wire) -> dispatch -> local experts (GEMM1 + SwiGLU + GEMM2,
    route weight in the epilogue) -> combine wire -> combine -> sum over top-k in fp32 -> [tokens]

Each (token, expert) contribution comes back as its own row and the source sums the top-k rows in
a fixed order, in fp32. That makes the bf16-wire result independent of the EP size (bit-identical
to the single-process layer), and a NaN token can only touch its own rows.

Two forwards compute the same thing:
- the device forward (CUDA, the Triton experts): four stages on fixed buffers — sender
  quantisation (one Triton launch), route kernel (ids -> pairs + id check), the experts writing the
  combine wire rows, the top-k sum kernel — no host synchronisation, no buffer sized by the data,
  capturable in a CUDA graph (layer/device/). Data checks report through a status word. At
  ep_size > 1 (MEGA_DISPATCH=symm | ipc) the same, across ranks: dispatch (quantise once, write
  into the owners' arenas) -> barrier -> the experts, GEMM2 writing into the source ranks' combine
  regions -> barrier -> top-k sum (layer/device/p2p.py).
- the torch forward (CPU / gloo, EP transports over torch.distributed, mori): the dispatch layout in
  torch, data checks on the host.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from ..experts import ExpertPairs, ExpertsProvider, ExpertWeights
from ..experts.registry import make_provider
from ..plan import LayerPlan
from ..plan.placement import PlacementError
from ..transport import PeerInputError, PeerTimeoutError, Transport, get_transport, received_pairs
from ..transport.cache import cached_transport_keys, get_workspace, transport_key
from ..transport.layout import DispatchLayout
from ..transport.registry import make_transport
from .ep_transport import resolve_ep_transport

P2P_TRANSPORTS = ("symm", "ipc")  # the device forward's transports at ep_size > 1 (peer arenas)

logger = logging.getLogger("megamoe")
if not logger.handlers:  # the startup line must reach engine logs even when nobody configured logging
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class MegaMoELayer:
    """One MoE layer's routed experts on this EP rank.

    ``weights`` holds this rank's local experts (``plan.num_local_experts`` of them, in local-slot
    order). ``group`` is the EP process group (None only for ep_size 1).
    """

    def __init__(
        self,
        plan: LayerPlan,
        weights: ExpertWeights,
        group: Any = None,
        device: torch.device | str | None = None,
        provider: ExpertsProvider | None = None,
        transport: Transport | None = None,
        layer_id: int = 0,
        device_path: bool | None = None,
        name: str | None = None,
    ) -> None:
        spec = plan.spec
        if weights.num_experts != plan.num_local_experts:
            raise ValueError(
                f"weights hold {weights.num_experts} experts, ep_rank {plan.ep_rank} owns {plan.num_local_experts}"
            )
        if weights.hidden != spec.hidden_size or weights.intermediate != spec.moe_intermediate_size:
            raise ValueError(
                f"weights are hidden={weights.hidden} inter={weights.intermediate}, the spec says "
                f"hidden={spec.hidden_size} inter={spec.moe_intermediate_size}"
            )
        self.plan = plan
        self.weights = weights
        self.device = torch.device(device) if device is not None else weights.w1.device
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" -> "cuda:N", as tensors report it
            self.device = torch.device("cuda", torch.cuda.current_device())
        if transport is None and device_path is not False:  # MEGA_DISPATCH=auto on CUDA: ipc / symm / nccl, with the group
            self.plan = plan = resolve_ep_transport(plan, group, self.device)
        self._owner, self._slot = plan.placement.tables(self.device)
        self.workspace = None  # the device forward's buffers (set below where it applies)
        if plan.backends.fused:
            # aiter's fused runtime owns dispatch, both GEMMs and combine (ROCm; see docs/rocm.md)
            from ..experts.aiter import AiterFusedMoE

            self.fused = AiterFusedMoE(plan, group, self.device, selection=plan.backends, layer_id=layer_id)
            self.fused_weights = self.fused.prepare_weights(weights)
            self.provider, self.transport = None, None
            return
        self.fused = None
        self.provider = provider or make_provider(plan.backends.provider, capacity=plan.mtpr * plan.topk * plan.ep_size)
        self.weights = self.provider.prepare_weights(weights, plan.math)
        self.name = name or f"layer {layer_id}"
        if device_path is None:
            device_path = self._device_path_applies(transport)
        if device_path:
            self._init_device_path(group)
            self.transport = None
            return
        if transport is None:
            key = transport_key(plan.layout_key(), group, self.device)
            is_new = key not in cached_transport_keys()
            transport = get_transport(plan.layout_key(), group, self.device, lambda: make_transport(plan, group, self.device))
            if is_new:
                logger.info(plan.startup_line(transport.name))
        self.transport = transport

    @property
    def transport_name(self) -> str:
        """What moves this layer's rows, as its startup line says it."""
        if self.workspace is not None:
            return "device" if self.plan.ep_size == 1 else f"device p2p over {self.plan.backends.transport}"
        return getattr(self.transport, "name", "fused")

    def _device_path_applies(self, transport: Transport | None) -> bool:
        """The sync-free forward runs on CUDA with the Triton experts, at ep_size 1 or over peer
        arenas (MEGA_DISPATCH=symm | ipc), unless a transport was injected (the caller asked for
        the torch forward's exchange)."""
        return (transport is None and self.device.type == "cuda" and getattr(self.provider, "name", "") == "triton"
                and (self.plan.ep_size == 1 or self.plan.backends.transport in P2P_TRANSPORTS))

    def _init_device_path(self, group: Any) -> None:
        from .device.workspace import DeviceWorkspace, P2PWorkspace

        plan = self.plan
        if plan.ep_size != 1 and plan.backends.transport not in P2P_TRANSPORTS:
            raise ValueError(f"the device forward runs at ep_size 1 or over MEGA_DISPATCH=symm | ipc (this plan: ep_size "
                             f"{plan.ep_size}, transport {plan.backends.transport})")
        if plan.combine.mx not in (None, "fp8"):
            raise ValueError(f"the device forward's top-k sum reads bf16 or fp8_blockwise_1x32 rows, not {plan.combine.name}")
        if plan.ep_size == 1:
            factory = lambda: DeviceWorkspace(plan, self.device)  # noqa: E731
        else:
            factory = lambda: P2PWorkspace(plan, group, self.device, plan.knobs.p2p_timeout_s)  # noqa: E731
        self.workspace, is_new = get_workspace(plan.layout_key(), group, self.device, factory)
        self._status_index = self.workspace.register_layer(self.name)
        if is_new:
            logger.info(plan.startup_line(self.transport_name))

    def _shape_status(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[int, str]:
        """(status, message) from shapes alone (no device data is read); status != 0: bad input."""
        plan = self.plan
        if x.dim() != 2 or x.shape[1] != plan.hidden:
            return 3, f"hidden_states must be [tokens, {plan.hidden}], got {tuple(x.shape)}"
        t = x.shape[0]
        if tuple(topk_ids.shape) != (t, plan.topk) or tuple(topk_weights.shape) != (t, plan.topk):
            return 3, (
                f"topk_ids / topk_weights must be [{t}, {plan.topk}], got {tuple(topk_ids.shape)} / "
                f"{tuple(topk_weights.shape)}"
            )
        if t > plan.mtpr:
            return 1, (
                f"{t} tokens on ep_rank {plan.ep_rank} exceed MEGA_MAX_TOKENS_PER_RANK={plan.mtpr}; "
                "raise the knob (or the engine's max batched tokens must stay below it); no token was dropped"
            )
        return 0, ""

    def _check_shapes(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """The device forward's input check: shapes, dtypes and devices only, raised here."""
        status, message = self._shape_status(x, topk_ids, topk_weights)
        if status == 1:
            raise PeerInputError(f"[megamoe] {message}")
        if status:
            raise ValueError(f"[megamoe] {message}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"[megamoe] topk_ids must be int32 or int64, got {topk_ids.dtype}")
        for tensor_name, tensor in (("hidden_states", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if tensor.device != self.device:
                raise ValueError(f"[megamoe] {tensor_name} is on {tensor.device}, the layer on {self.device}")

    def raise_if_bad_input(self) -> None:
        """Raise what the device checks recorded in earlier forwards (finished on the GPU) and clear it.

        Called at the start of every eager forward; engines that replay CUDA graphs may call it once
        per step (a host read of pinned memory: no stall). A peer that timed out (P2P forward) leaves
        the workspace broken: every later forward of this shape raises the same error at once."""
        ws = self.workspace
        if ws is None:
            return
        if ws.broken:
            raise PeerTimeoutError(ws.broken)
        try:
            ws.status.raise_if_bad(ws.layer_names)
        except PeerTimeoutError as exc:
            ws.broken = str(exc)
            raise

    def _output(self, t: int, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return torch.empty(t, self.plan.hidden, dtype=torch.bfloat16, device=self.device)
        hidden = self.plan.hidden
        if out.shape != (t, hidden) or out.dtype != torch.bfloat16 or out.stride(1) != 1 or out.device != self.device:
            raise ValueError(f"[megamoe] out must be bf16 [{t}, {hidden}] on {self.device}, got {tuple(out.shape)} {out.dtype}")
        return out

    def _forward_p2p(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, output_scale: float,
                     out: torch.Tensor | None, max_tokens_across_ranks: int | None) -> torch.Tensor:
        """The device forward across ranks (module docstring, layer/device/p2p.py): every rank runs
        it, also with 0 tokens; nothing here reads the device or sizes a buffer by the data."""
        from .device.p2p import barrier, dispatch
        from .device.topk_sum import topk_sum

        plan, ws = self.plan, self.workspace
        if ws.broken:
            raise PeerTimeoutError(ws.broken)
        self._check_shapes(x, topk_ids, topk_weights)
        if not _capturing(self.device):
            self.raise_if_bad_input()
        t, k, hidden = x.shape[0], plan.topk, plan.hidden
        rows = plan.mtpr if max_tokens_across_ranks is None else int(max_tokens_across_ranks)
        if not t <= rows <= plan.mtpr or rows < 1:
            raise PeerInputError(
                f"[megamoe] {self.name}: max_tokens_across_ranks={max_tokens_across_ranks} must lie in [tokens on this rank "
                f"({t}), MEGA_MAX_TOKENS_PER_RANK={plan.mtpr}] and be >= 1; no token was dropped")
        out = self._output(t, out)
        word, index = ws.status.word, self._status_index
        dispatch(x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), self._owner, self._slot, rows, ws.arena,
                 ws.wire.name, hidden, ws.pair_live, ws.dest, word, index)
        barrier(ws.arena, ws.epochs, 0, ws.budget, rows, word, index)
        n_recv = plan.ep_size * rows
        rows_a = ws.wire.view(ws.recv_rows[:n_recv], hidden)
        n_pairs = n_recv * k
        pairs = ExpertPairs(row=ws.pair_row[:n_pairs], slot=ws.recv_slot[:n_pairs], weight=ws.recv_weight[:n_pairs])
        # GEMM2 writes each received pair's row into its source rank's combine region (ws.dest)
        self.provider.forward_wire(rows_a, pairs, self.weights, plan.math, plan.combine, out=ws.arena.local,
                                   dest=ws.dest[:n_pairs])
        barrier(ws.arena, ws.epochs, 1, ws.budget, rows, word, index)
        if t:
            topk_sum(ws.combine_rows[: t * k], ws.pair_live[: t * k], out, plan.combine.mx, hidden, k, word, index,
                     output_scale)
        ws.status.publish()
        return out

    def _forward_device(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        output_scale: float, out: torch.Tensor | None) -> torch.Tensor:
        from ..experts.triton.quant import encode_wire_rows
        from ..formats import dispatch_wire
        from .device.route import route_pairs
        from .device.status import NONFINITE_INPUT
        from .device.topk_sum import topk_sum

        plan, ws = self.plan, self.workspace
        self._check_shapes(x, topk_ids, topk_weights)
        if not _capturing(self.device):
            self.raise_if_bad_input()
        t, k, hidden = x.shape[0], plan.topk, plan.hidden
        out = self._output(t, out)
        if t == 0:
            return out
        n = t * k
        pair_slot, pair_weight = ws.pair_slot[:n], ws.pair_weight[:n]
        route_pairs(topk_ids, topk_weights, self._owner, self._slot, plan.ep_rank, pair_slot, pair_weight,
                    ws.status.word, self._status_index)
        a_fmt = ws.a_format
        if a_fmt is None:
            rows_a = x.to(torch.bfloat16).contiguous()  # bf16 activations: the rows as they are
        else:
            # one quantisation per token into the A format (= the quantised dispatch wire; with the bf16
            # wire at ep_size 1 it is the receiver's quantisation, the same bits), reporting NaN / Inf rows
            rows = encode_wire_rows(x.contiguous(), a_fmt, out=ws.token_rows[:t],
                                    status=(ws.status.word, NONFINITE_INPUT, self._status_index))
            rows_a = dispatch_wire(a_fmt).view(rows, hidden)
        pairs = ExpertPairs(row=ws.pair_row[:n], slot=pair_slot, weight=pair_weight)
        wire_rows = self.provider.forward_wire(rows_a, pairs, self.weights, plan.math, plan.combine, out=ws.combine_rows[:n])
        topk_sum(wire_rows, pair_slot, out, plan.combine.mx, hidden, k, ws.status.word, self._status_index, output_scale)
        ws.status.publish()
        return out

    def expert_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this rank's experts compute with (the provider-prepared ``self.weights``), by
        field, each contiguous with one row per local slot: what an engine's EPLB moves between ranks
        in place (vLLM ``get_expert_weights``, SGLang ``get_moe_weights``). From this call on the
        provider keeps nothing derived from them, so every forward reads what the engine moved there;
        the placement's physical ids never move (only which logical expert a slot holds), so the
        routing tables stay valid.
        """
        if self.fused is not None:
            raise PlacementError(
                "[megamoe] EPLB with aiter's fused runtime is not supported: its weights are aiter-shuffled "
                "copies that no engine can move per expert; serve without EPLB there (ROCm)"
            )
        tensors = self.weights.expert_tensors()
        self.provider.weights_become_movable(self.weights)
        return tensors

    def _check_inputs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[int, str]:
        """(status, message) for this rank's input (the torch forward: shapes, then the ids on the
        host); status != 0 is reported to every rank."""
        status, message = self._shape_status(x, topk_ids, topk_weights)
        if status:
            return status, message
        num_physical = self.plan.placement.num_physical
        if x.shape[0] and (bool((topk_ids < -1).any()) or bool((topk_ids >= num_physical).any())):
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            return 2, f"topk_ids hold values in [{lo}, {hi}]; valid are -1 (masked) and 0..{num_physical - 1}"
        return 0, ""

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, output_scale: float = 1.0,
        out: torch.Tensor | None = None, max_tokens_across_ranks: int | None = None,
    ) -> torch.Tensor:
        """x [T, H] (bf16/fp32), topk_ids [T, k] (-1 = masked), topk_weights [T, k] -> bf16 [T, H].

        ``output_scale`` multiplies the fp32 sum before the one bf16 rounding (engines that apply
        routed_scaling_factor after the experts pass it here instead of rounding twice). ``out``
        (device forward only) is a bf16 [T, H] buffer to write instead of a new tensor.
        ``max_tokens_across_ranks`` (device P2P forward only): the most tokens any rank brings to this
        forward, the SAME number on every rank (DP-padded batch sizes, as engines replay one graph
        size on all ranks); the receive regions and expert grids are sized by it instead of
        MEGA_MAX_TOKENS_PER_RANK. Ranks that disagree get an error from the device check, not
        silent garbage.
        """
        if self.workspace is not None and self.plan.ep_size > 1:
            return self._forward_p2p(x, topk_ids, topk_weights, output_scale, out, max_tokens_across_ranks)
        if self.workspace is not None:
            return self._forward_device(x, topk_ids, topk_weights, output_scale, out)
        if out is not None or max_tokens_across_ranks is not None:
            raise ValueError("[megamoe] out= / max_tokens_across_ranks= are supported by the device forward only")
        if _capturing(self.device):
            raise RuntimeError(
                f"[megamoe] {self.name}: this forward (ep_size {self.plan.ep_size}, transport "
                f"{getattr(self.transport, 'name', 'fused')}) reads row counts on the host and cannot be captured in a "
                "CUDA graph; only the device forward (CUDA, triton experts, ep_size 1 or MEGA_DISPATCH=symm | ipc) can. "
                "Use one of those, or run the engine eagerly (vLLM --enforce-eager, SGLang --disable-cuda-graph)."
            )
        plan = self.plan
        status, message = self._check_inputs(x, topk_ids, topk_weights)
        if self.fused is not None:
            if status:
                raise PeerInputError(f"[megamoe] {message}")
            out = self.fused(x, topk_ids, topk_weights, self.fused_weights)
            return out if output_scale == 1.0 else (out.float() * output_scale).to(torch.bfloat16)
        if status:
            # Still take part in the header exchange with nothing to send, so peers fail fast too.
            x = torch.zeros(0, plan.hidden, dtype=torch.bfloat16, device=self.device)
            topk_ids = torch.zeros(0, plan.topk, dtype=torch.int64, device=self.device)
            topk_weights = torch.zeros(0, plan.topk, dtype=torch.float32, device=self.device)
        topk_ids = topk_ids.to(torch.int64)
        token_rows = plan.dispatch.encode(x)  # one quantisation per token, whatever the fan-out
        layout = DispatchLayout.build(topk_ids, topk_weights, self._owner, self._slot, plan.ep_size)
        try:
            received = self.transport.dispatch(token_rows, layout, status)
        except PeerInputError as exc:
            if status:
                raise PeerInputError(f"[megamoe] {message}") from exc
            raise

        rows_a = plan.dispatch.decode(received.rows, plan.hidden)
        pair_row, pair_k = received_pairs(received.slots)
        pairs = ExpertPairs(
            row=pair_row,
            slot=received.slots[pair_row, pair_k].to(torch.int64),
            weight=received.weights[pair_row, pair_k],
        )
        if getattr(self.transport, "reduces_in_combine", False):
            # mori sums a token's rows across ranks inside its combine kernel (and quantises there)
            contributions = self.provider.forward(rows_a, pairs, self.weights, plan.math)
            summed = self.transport.combine_reduced(contributions, received.handle)
            return (summed * output_scale).to(torch.bfloat16)
        # the provider writes the combine wire rows (Triton: in GEMM2's epilogue, no fp32 rows in memory)
        pair_wire_rows = self.provider.forward_wire(rows_a, pairs, self.weights, plan.math, plan.combine)
        returned = self.transport.combine(pair_wire_rows, received.handle)

        values = plan.combine.decode_fp32(returned, plan.hidden)
        per_topk = torch.zeros(layout.num_tokens, plan.topk, plan.hidden, dtype=torch.float32, device=self.device)
        per_topk[layout.pair_token, layout.pair_k] = values
        summed = per_topk.sum(dim=1)
        if output_scale != 1.0:
            summed = summed * output_scale
        return summed.to(torch.bfloat16)

    __call__ = forward


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
