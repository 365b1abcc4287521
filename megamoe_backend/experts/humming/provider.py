"""HummingExperts: the experts on humming-kernels' grouped GEMMs (NVIDIA Hopper, A8W4 and block-FP8).

Same contract as every provider (experts/base.py); the numerics are the frag8 path's: A as e4m3 over one
power-of-two fp32 scale per row (re-expressed from the MX fp8 wire rows), MXFP4 weights, SwiGLU (+ clamp)
on the gate/up rows as the project interleaves them, A2 re-quantised to MX fp8 and re-expressed the same
way. What differs from the Triton provider: humming's GEMM1 writes bf16 gate/up rows (its output types are
bf16 / fp16), so SwiGLU reads h rounded to bf16, and GEMM2's bf16 rows are the route-weighted outputs
(the route weight rides in GEMM2's per-row input scale), so ``forward`` returns those bf16 values in fp32.

A forward, all on the current stream with no host synchronisation (capturable for a fixed pair count):
  1. A rows -> e4m3 + row scale, once per received row (the live ones: LiveRows) -- gather.rowscale_e4m3_kernel
     in natural K order (a bf16 wire is quantised to MX fp8 first, on the receiver, as the Triton path does);
  2. the expert-sorted layout (triton/layout.py) at the tile height of the kernel humming picks for the
     bound's row count, and its padded row count live_tiles x BM: humming's kernels read it on the device
     and walk those tiles only, so the work follows the live pairs;
  3. GEMM1 (humming, indexed: reads A row pair // k, writes row pair), then ``swiglu_a2_kernel``;
  4. GEMM2 (humming, indexed, top-k 1) into the combine wire rows themselves (bf16 wire, rows in pair order),
     else into a bf16 scratch and ``finalize_kernel`` writes them (fp32 rows, a destination, the fp8 wire).
Block-FP8 experts (quant fp8_block: DeepSeek V3 / R1 FP8 checkpoints) run the same order on humming's 128 x 128
block-scaled GEMMs: A is the fp8_g128 rows themselves (copied into contiguous tensors, humming's launcher takes no
row stride; a bf16 wire is quantised to fp8_g128 on the receiver), GEMM1 writes bf16 [gate; up] rows (the
checkpoint's plain order), ``swiglu_g128_kernel`` quantises A2 in 1 x 128 groups with the route weight folded into
each group scale, GEMM2 and the finalize as above.
The host picks humming's kernel from ``valid_shape_m``: the bound the layer passes (LiveRows.config_pairs,
the engine's DP-padded tokens x k), else this forward's pair count. Its kernels are compiled at
prepare_weights (the layer's build, before any bounded wait) and the time is logged.

Pairs: GEMM1 reads A row ``pair // k`` without reading ``pairs.row``, so a forward takes the layer's
row-major pairs (``pairs.per_row`` = k: pair q reads received row q // k) at no cost; other pairs (the
eager torch forward's) are gathered per pair first (an indexing copy of the rows, eager only).
"""

from __future__ import annotations

import logging
import time
import weakref

import torch
import triton

from ...formats import MXTensor
from ...formats.block_fp8 import FP8_BLOCK, GroupFP8Tensor
from ...formats.wire import WireFormat
from ..base import Activations, ExpertMath, ExpertPairs, ExpertsProvider
from ..live import LiveRows, SegmentDest
from ..scratch import ExpertsScratch, scratch_empty
from ..weights import ExpertWeights
from ..triton.checks import check_capacity, check_live, check_pairs, received_rows, result_buffer, wire_target
from ..triton.config import interpreting
from ..triton.forward_buffers import ForwardBuffers
from ..triton.launch_plan import persistent_grid
from ..triton.layout import ExpertLayout, build_layout
from .weights import to_humming

FINALIZE_BN = 1024  # columns per finalize step (a multiple of 32: whole fp8 wire blocks)
QUANT_OF_FMT = {"mxfp4": "a8w4", "fp8_block": "fp8_block"}  # the weights' format -> the scheme humming runs on it
log = logging.getLogger("megamoe")


class HummingExperts(ExpertsProvider):
    """capacity: most pairs one forward may carry (MTPR x top-k x ep_size), as TritonExperts; the scratch is
    reserved for it. library: the humming adapter (library.py, the default); tests pass an emulation of its
    indexed GEMM (tests/experts_humming/emulation.py) to run the rest of the provider on the CPU."""

    name = "humming"

    def __init__(self, capacity: int | None = None, library=None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity={capacity} must be >= 0")
        if library is None:
            from . import library
        self.capacity = capacity
        self.library = library
        self._prepared: dict[int, tuple[weakref.ref, tuple]] = {}  # id(weights) -> (weakref, (w13, w2) sublayers)
        self._locks: dict[torch.device, torch.Tensor] = {}
        self.jit_report: dict | None = None  # kernels, seconds: the first-use compile of prepare_weights

    @classmethod
    def supports(cls, device: torch.device, math: ExpertMath, weights_fmt: str) -> bool:
        device = torch.device(device)
        return (QUANT_OF_FMT.get(weights_fmt) == math.quant and device.type == "cuda" and torch.version.hip is None
                and torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0))

    def prepare_weights(self, weights: ExpertWeights, math: ExpertMath | None = None) -> ExpertWeights:
        """MXFP4 or block-FP8 weights -> humming's layout (in their place: one copy), then every kernel compiled:
        the first-use cost is paid here, at the layer's build, and logged (humming caches the compiled kernels
        on disk, so a later process loads them)."""
        if math is not None:
            _check_scheme(weights.fmt, math)
        if weights.storage == "humming":
            self._sublayers(weights)
            return weights
        start = time.perf_counter()
        prepared, subs = to_humming(weights, self.library)
        repack_s = time.perf_counter() - start
        kernels, jit_s = self.library.jit(subs, weights.w1.device)
        self._prepared[id(prepared)] = (weakref.ref(prepared), subs)
        self.jit_report = {"kernels": kernels, "jit_s": jit_s, "repack_s": repack_s}
        log.info("[megamoe] humming-kernels %s: weights repacked in %.2f s, %d GEMM kernels ready in %.1f s (first use "
                 "compiles them with NVRTC, later processes load humming's disk cache)", self.library.version(),
                 repack_s, kernels, jit_s)
        return prepared

    def _sublayers(self, weights: ExpertWeights) -> tuple:
        hit = self._prepared.get(id(weights))
        if hit is None or hit[0]() is not weights:
            raise ValueError("weights for HummingExperts must come from its prepare_weights (humming's layout and "
                             "compiled kernels belong to them)")
        return hit[1]

    def forward(self, a: Activations, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """See ExpertsProvider.forward (the values are GEMM2's bf16 rows: module docstring)."""
        out = result_buffer(out, len(pairs), weights.hidden, torch.float32, pairs.weight.device, "fp32 rows")
        return self._run(a, pairs, weights, math, out, "f32")

    def forward_wire(
        self, a: Activations, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath, wire: WireFormat,
        *, out: torch.Tensor | None = None, dest: torch.Tensor | SegmentDest | None = None, live: LiveRows | None = None,
        scratch: ExpertsScratch | None = None,
    ) -> torch.Tensor:
        """See ExpertsProvider.forward_wire; ``out`` / ``dest`` / ``live`` / ``scratch`` as TritonExperts.forward_wire."""
        out, target, out_fmt = wire_target(out, dest, len(pairs), wire, weights.hidden, pairs.weight.device,
                                           "the humming experts' GEMM2 / finalize")
        self._run(a, pairs, weights, math, target, out_fmt, dest, live, scratch)
        return out

    def _run(self, a, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath, out: torch.Tensor, out_fmt: str,
             dest=None, live: LiveRows | None = None, scratch: ExpertsScratch | None = None) -> torch.Tensor:
        """The forward (module docstring); ``out`` is GEMM2's destination in ``out_fmt`` ("f32" or the wire's
        "bf16" / "fp8"), or with ``dest`` the base its byte offsets count from."""
        _check_scheme(weights.fmt, math)
        w13, w2 = self._sublayers(weights)
        device, p = pairs.weight.device, len(pairs)
        check_pairs(pairs)
        check_capacity(p, self.capacity)
        x = received_rows(a, math, weights.hidden, device)
        if live is not None and p:
            check_live(live, x, p, device)
        if p == 0:
            return out
        x, top_k = self._rows_per_pair(x, pairs, live)
        n_recv = (x if isinstance(x, torch.Tensor) else x.data).shape[0]
        bufs = ForwardBuffers(scratch, device, p, n_recv, self.capacity)
        valid_m = live.config_pairs if live is not None and live.config_pairs else p
        block = weights.fmt == "fp8_block"
        a8, a_rs = self._group_operand(x, bufs, live) if block else self._a_operand(x, bufs, live)
        hidden, inter, e = weights.hidden, weights.intermediate, weights.num_experts
        locks = self._locks_for(device, scratch)

        bm1 = w13.block_m(valid_m)
        lay1 = build_layout(pairs.slot, e, bm1, self.capacity, live=live, all_tiles=False, scratch=scratch)
        rows1 = self._padded_rows(lay1, bufs, "humming.rows1")
        direct = dest is None and out_fmt == "bf16"  # GEMM2's rows are the bf16 wire rows, in pair order
        h, c = self._gate_up_and_gemm2_rows(bufs, p, inter, hidden, direct)
        w13.gemm(a8, a_rs, weights.w1, weights.w1_scale, weights.w1_row_scale, h, lay1.sorted_pair, lay1.tile_expert,
                 rows1, locks, top_k, valid_m)
        a2 = bufs.per_pair("humming.a2", (p, inter), torch.uint8)
        a2_rs = bufs.per_pair("humming.a2_rs", (p, inter // FP8_BLOCK if block else 1), torch.float32)
        (self._swiglu_g128 if block else self._swiglu_a2)(lay1, h, pairs.weight, a2, a2_rs, inter, math.swiglu_limit)

        bm2 = w2.block_m(valid_m)
        lay2 = lay1 if bm2 == bm1 else build_layout(pairs.slot, e, bm2, self.capacity, live=live, all_tiles=False,
                                                    scratch=scratch)
        rows2 = rows1 if lay2 is lay1 else self._padded_rows(lay2, bufs, "humming.rows2")
        c = out if direct else c
        w2.gemm(a2.view(torch.float8_e4m3fn), a2_rs, weights.w2, weights.w2_scale, weights.w2_row_scale, c,
                lay2.sorted_pair, lay2.tile_expert, rows2, locks, 1, valid_m)
        if not direct:
            self._finalize(lay2, c, out, out_fmt, dest)
        return out

    @staticmethod
    def _gate_up_and_gemm2_rows(bufs: ForwardBuffers, p: int, inter: int, hidden: int, direct: bool):
        """(GEMM1's bf16 gate/up rows [p, 2I], GEMM2's bf16 rows [p, H] or None where GEMM2 writes the output
        itself). Both index rows by pair, so at an EP rank's capacity (MTPR x top-k x ep_size pairs) they are
        the bulk of the scratch; they share one buffer: h is dead once the SwiGLU kernel has read it, before
        GEMM2 writes c (stream order, also inside a graph), so a pair of capacity holds max(4I, 2H) bytes, not
        4I + 2H (footprint.py counts the same)."""
        if direct:
            return bufs.per_pair("humming.h", (p, 2 * inter), torch.bfloat16), None
        shared = bufs.per_pair("humming.h_c", (p, max(2 * inter, hidden)), torch.bfloat16).view(-1)
        return shared[: p * 2 * inter].view(p, 2 * inter), shared[: p * hidden].view(p, hidden)

    @staticmethod
    def _rows_per_pair(x, pairs: ExpertPairs, live: LiveRows | None):
        """(rows GEMM1 reads, k) with pair q reading row q // k: the received rows as they are for row-major
        pairs (the layer's device forwards; LiveRows implies them), else the rows gathered per pair (k = 1)."""
        n_recv = (x if isinstance(x, torch.Tensor) else x.data).shape[0]
        k = pairs.per_row or (len(pairs) // n_recv if live is not None else 0)
        if k:
            if n_recv * k != len(pairs):
                raise ValueError(f"pairs.per_row={k}: {len(pairs)} pairs are not {k} per received row ({n_recv} rows)")
            return x, k
        if isinstance(x, (MXTensor, GroupFP8Tensor)):
            return type(x)(x.data[pairs.row].contiguous(), x.scales[pairs.row].contiguous(), x.fmt), 1
        return x[pairs.row].contiguous(), 1

    def _a_operand(self, x, bufs: ForwardBuffers, live: LiveRows | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Received rows -> (e4m3 [N, H] in natural K order, fp32 [N, 1] row scales), the live rows only with ``live``."""
        from ..triton.gather import rowscale_e4m3_kernel, rowscale_piece
        from ..triton.layout_kernels import live_rows_args
        from ..triton.quant import quantize_rows

        device = bufs.device
        programs = persistent_grid(device)
        if not isinstance(x, MXTensor):  # the bf16 wire: quantised on the receiver, as the Triton path does
            n, hidden = x.shape
            data = bufs.per_received_row("humming.a_mx", (n, hidden), torch.uint8)
            scales = bufs.per_received_row("humming.a_mx_scale", (n, hidden // 32), torch.uint8)
            x = quantize_rows(x, "fp8", name="received rows", out=(data, scales), live=live,
                              programs=None if live is None else programs)
        n, hidden = x.data.shape
        a8 = bufs.per_received_row("humming.a8", (n, hidden), torch.uint8)
        a_rs = bufs.per_received_row("humming.a_rs", (n, 1), torch.float32)
        walk = {} if live is None else live_rows_args(live)
        rowscale_e4m3_kernel[(n if live is None else min(n, programs),)](
            x.data, x.data, x.data.stride(0), x.scales, x.scales.stride(0), a8, a8.stride(0), a_rs, hidden,
            A_FMT="fp8", SORTED=False, NB=triton.next_power_of_2(hidden // 32), PK=rowscale_piece(hidden),
            HW_CVT=device.type == "cuda" and not interpreting(), FRAG8_ORDER=False, num_warps=2, **walk,
        )
        return a8.view(torch.float8_e4m3fn), a_rs

    def _group_operand(self, x, bufs: ForwardBuffers, live: LiveRows | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Received rows -> (e4m3 [N, H], fp32 [N, H / 128]) contiguous, as humming's launcher takes A and its group
        scales: fp8_g128 rows copied (the live ones only with ``live``), bf16 rows quantised into them."""
        from ..triton.layout_kernels import live_rows_args
        from ..triton.quant import quantize_rows
        from .kernels import group_rows_kernel

        device = bufs.device
        n, hidden = (x if isinstance(x, torch.Tensor) else x.data).shape
        groups = hidden // FP8_BLOCK
        a8 = bufs.per_received_row("humming.a8", (n, hidden), torch.uint8)
        a_s = bufs.per_received_row("humming.a_gs", (n, groups), torch.float32)
        programs = persistent_grid(device)
        if isinstance(x, torch.Tensor):  # the bf16 wire: quantised on the receiver, as the Triton path does
            quantize_rows(x, "fp8_g128", name="received rows", out=(a8, a_s), live=live,
                          programs=None if live is None else programs)
        else:
            walk = {} if live is None else live_rows_args(live)
            group_rows_kernel[(n if live is None else min(n, programs),)](
                x.data, x.data.stride(0), x.scales, x.scales.stride(0), a8, a_s, hidden, groups, BK=1024,
                NG=triton.next_power_of_2(groups), num_warps=4, **walk)
        return a8.view(torch.float8_e4m3fn), a_s

    @staticmethod
    def _padded_rows(layout: ExpertLayout, bufs: ForwardBuffers, name: str) -> torch.Tensor:
        """int32 [1] = live_tiles x BM on the device: humming's num_tokens_padded (its kernels walk those rows)."""
        rows = scratch_empty(bufs.scratch, name, (1,), torch.int32, bufs.device)
        return torch.mul(layout.live_tiles, layout.block_m, out=rows)

    def _locks_for(self, device: torch.device, scratch: ExpertsScratch | None) -> torch.Tensor:
        """humming's stream-K locks: zero when allocated, left zero by its kernels; one set per scratch or device."""
        if scratch is not None:
            return scratch.counters("humming.locks", self.library.locks(device).numel())
        if device not in self._locks:
            self._locks[device] = self.library.locks(device)
        return self._locks[device]

    @staticmethod
    def _swiglu_a2(layout: ExpertLayout, h, route_w, a2, a2_rs, inter: int, limit: float | None) -> None:
        from .kernels import swiglu_a2_kernel

        device = h.device
        swiglu_a2_kernel[(persistent_grid(device),)](
            layout.sorted_pair, layout.live_tiles, layout.block_m, h, h.stride(0), route_w, a2, a2.stride(0), a2_rs,
            inter, float(limit) if limit is not None else 0.0, NI=triton.next_power_of_2(inter),
            HAS_LIMIT=limit is not None, HW_CVT=device.type == "cuda" and not interpreting(), num_warps=8,
        )

    @staticmethod
    def _swiglu_g128(layout: ExpertLayout, h, route_w, a2, a2_s, inter: int, limit: float | None) -> None:
        from .kernels import swiglu_g128_kernel

        device = h.device
        swiglu_g128_kernel[(persistent_grid(device),)](
            layout.sorted_pair, layout.live_tiles, layout.block_m, h, h.stride(0), route_w, a2, a2.stride(0), a2_s,
            a2_s.stride(0), inter, float(limit) if limit is not None else 0.0, HAS_LIMIT=limit is not None,
            HW_CVT=device.type == "cuda" and not interpreting(), num_warps=4,
        )

    @staticmethod
    def _finalize(layout: ExpertLayout, c: torch.Tensor, out: torch.Tensor, out_fmt: str, dest) -> None:
        from .kernels import finalize_kernel

        if dest is None:
            mode, ptr, seg_pairs, seg_bytes, stride = 0, c, 1, 0, out.stride(0)
        elif isinstance(dest, SegmentDest):
            mode, ptr, seg_pairs, seg_bytes, stride = 2, dest.base, dest.seg_pairs, dest.row_bytes, 0
        else:
            mode, ptr, seg_pairs, seg_bytes, stride = 1, dest, 1, 0, 0
        finalize_kernel[(persistent_grid(c.device),)](
            layout.sorted_pair, layout.live_tiles, layout.block_m, c, c.stride(0), out, stride, ptr, seg_pairs, seg_bytes,
            c.shape[1], OUT_FMT=out_fmt, DEST=mode, BN=FINALIZE_BN, HW_CVT=c.device.type == "cuda" and not interpreting(),
            num_warps=4,
        )


def _check_scheme(weights_fmt: str, math: ExpertMath) -> None:
    """humming runs A8W4 on MXFP4 weights and block-FP8 on block-FP8 weights (QUANT_OF_FMT); anything else is named."""
    want = QUANT_OF_FMT.get(weights_fmt)
    if want is None:
        raise ValueError(f"humming experts take MXFP4 or block-FP8 weights, not {weights_fmt}")
    if math.quant != want:
        raise ValueError(f"humming experts run {want} on {weights_fmt} weights (A8W4: fp8 activations on MXFP4 weights; "
                         f"fp8_block: 1 x 128 FP8 groups on 128 x 128 FP8 blocks), not quant={math.quant}")


__all__ = ["HummingExperts"]
