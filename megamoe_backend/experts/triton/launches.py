"""The kernel launches of one Triton experts forward, in their order: the received rows quantised
(bf16 wire, MX math), the A operand converted once per received row, then per tile config GEMM1 +
SwiGLU, frag8's A2 row re-scale and GEMM2 (launch_plan.py says which configs, grids and passes;
forward_buffers.py where the intermediates live).

Every function here launches on the current stream over tensors it is handed or takes from the
forward's buffers: no host synchronisation and, with the layer's scratch, no allocation once a
forward has run, so a forward is CUDA-graph capturable for a fixed pair count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ...formats import MX_BLOCK, MXTensor
from ...formats.block_fp8 import A_FORMAT as FP8_G128
from ...formats.block_fp8 import FP8_BLOCK
from ..base import ExpertPairs
from ..fragments import FP8_K
from ..live import LiveRows, SegmentDest
from ..weights import ExpertWeights
from .config import TileConfig, interpreting, reduction_block
from .forward_buffers import ForwardBuffers
from .launch_plan import LaunchPlan, grid, persistent_grid, register_cap, tile_passes, whole_weight_tiles
from .layout import ExpertLayout
from .pdl import pdl_args, pdl_launch

DEST_VECTOR_BYTES = 16  # the widest store GEMM2's epilogue issues: alignment beyond it buys nothing


@dataclass(frozen=True)
class Operand:
    """A GEMM's A operand as its kernel reads it: data and scale pointers, one fp32 scale per row
    (frag8; else a placeholder the kernels ignore) and the A_FMT the kernel is compiled for."""

    data: torch.Tensor
    scale: torch.Tensor
    row_scale: torch.Tensor
    fmt: str


@dataclass(frozen=True)
class ForwardLaunch:
    """What every launch of one forward shares. ``pairs.weight`` doubles as the placeholder pointer
    of arguments a mode does not read (row scales outside frag8, live tiles without live rows)."""

    weights: ExpertWeights
    pairs: ExpertPairs
    mode: str  # the decoder (provider.resolve_decoder): the kernels' DECODE
    a_fmt: str  # the A operand's format: "fp8" / "fp4" (MX), "fp8_g128" (block-FP8) or "bf16"
    limit: float | None  # SwiGLU clamp
    plan: LaunchPlan
    claims: torch.Tensor  # the persistent GEMMs' counters (ForwardBuffers.gemm_claims), else a placeholder
    use_asm: bool  # inline PTX (CUDA, not the interpreter)
    pdl: bool  # programmatic dependent launch between this forward's kernels (pdl.pdl_launch)

    def weight_row_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1, w2) fp32 row scales: frag8 weights carry them (fragments.py), the others need none."""
        if self.mode == "frag8":
            return self.weights.w1_row_scale, self.weights.w2_row_scale
        return self.pairs.weight, self.pairs.weight


def forward_launch(weights: ExpertWeights, pairs: ExpertPairs, mode: str, a_fmt: str, limit: float | None,
                   plan: LaunchPlan, bufs: ForwardBuffers) -> ForwardLaunch:
    claims = bufs.gemm_claims() if plan.persist else pairs.slot  # unused by one-tile programs
    use_asm = pairs.weight.device.type == "cuda" and not interpreting()
    return ForwardLaunch(weights, pairs, mode, a_fmt, limit, plan, claims, use_asm, pdl_launch(pairs.weight.device))


def e4m3_dtype() -> torch.dtype:
    """frag8's and block_fp8's e4m3 bytes, typed for the FP8 MMA loads (the interpreter reads them as bytes)."""
    return torch.uint8 if interpreting() else torch.float8_e4m3fn


def weight_operands(w: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1, w1 scales, w2, w2 scales) as the GEMMs read them: block-FP8 e4m3 typed by e4m3_dtype; bf16 weights
    have no scales (the weights stand in for the pointer)."""
    if w.fmt == "fp8_block":
        return w.w1.view(e4m3_dtype()), w.w1_scale, w.w2.view(e4m3_dtype()), w.w2_scale
    if w.fmt == "mxfp4":
        return w.w1, w.w1_scale, w.w2, w.w2_scale
    return w.w1, w.w1, w.w2, w.w2


def operand_pointers(x, a_fmt: str, dot_scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scales) pointers for the kernels; fp8 data is viewed as float8 for tl.dot_scaled."""
    if a_fmt == "bf16":
        return x, x
    if a_fmt == FP8_G128:
        return x.data.view(e4m3_dtype()), x.scales
    data = x.data.view(torch.float8_e4m3fn) if (a_fmt == "fp8" and dot_scaled) else x.data
    return data, x.scales


def quantise_received(x: torch.Tensor, a_fmt: str, bufs: ForwardBuffers, live: LiveRows | None):
    """bf16 wire rows -> the A format (MXTensor, or GroupFP8Tensor for fp8_g128), on the receiver (the live
    rows only, with ``live``)."""
    from .quant import quantize_rows

    n_recv, hidden = x.shape
    qdata = bufs.per_received_row("a_mx", (n_recv, hidden // 2 if a_fmt == "fp4" else hidden), torch.uint8)
    if a_fmt == FP8_G128:
        qscale = bufs.per_received_row("a_g128_scale", (n_recv, hidden // FP8_BLOCK), torch.float32)
    else:
        qscale = bufs.per_received_row("a_mx_scale", (n_recv, hidden // MX_BLOCK), torch.uint8)
    programs = None if live is None else persistent_grid(x.device)  # live rows: a fixed grid walks them
    return quantize_rows(x, a_fmt, name="received rows", out=(qdata, qscale), live=live, programs=programs)


def convert_a(fl: ForwardLaunch, x, bufs: ForwardBuffers, live: LiveRows | None) -> Operand:
    """The A operand once per received row, as the decoder reads it (GEMM1 reads it through
    layout.sorted_row: not a copy per pair): frag8 re-scales the MX rows to e4m3 over one fp32 scale
    per row; split (and frag with MX rows) converts them to bf16 (split: pre-split for its decode)."""
    from .gather import gather_split_kernel, rowscale_e4m3_kernel, rowscale_piece
    from .layout_kernels import live_rows_args

    data, scale = operand_pointers(x, fl.a_fmt, fl.mode == "dot_scaled")
    n_recv, hidden = data.shape[0], fl.weights.hidden
    if fl.mode == "block_fp8":  # GEMM1 reads the e4m3 rows and their group scales as they arrived
        return Operand(data, scale, fl.pairs.weight, fl.a_fmt)
    if fl.mode == "frag8":
        a8 = bufs.per_received_row("a8", (n_recv, hidden), torch.uint8)
        a_rs = bufs.per_received_row("a_rs", (n_recv,), torch.float32)
        # 2 warps per row: fastest of 1 / 2 / 4 / 8 at 8192 tokens, within noise of them at 1024 (rowscale_ab.py at 64d6ae2)
        rowscale_e4m3_kernel[(grid(n_recv, fl.plan.rescale_programs),)](
            fl.pairs.row, data, data.stride(0), scale, scale.stride(0), a8, a8.stride(0), a_rs, hidden,
            A_FMT=fl.a_fmt, SORTED=False, NB=triton.next_power_of_2(hidden // MX_BLOCK), PK=rowscale_piece(hidden),
            HW_CVT=fl.use_asm, num_warps=2, **pdl_args(fl.pdl),
            **({} if live is None else live_rows_args(live)),  # walk the live received rows
        )
        return Operand(a8.view(e4m3_dtype()), a8, a_rs, fl.a_fmt)
    if fl.mode == "split" or (fl.mode == "frag" and fl.a_fmt != "bf16"):  # bf16 rows in natural order are frag's A
        # one program per received row (not walking LiveRows: the default decoders at DeepSeek shapes are frag8 for MX
        # activations and none for bf16 rows; stale rows are converted and never read)
        bk = reduction_block(hidden, fl.plan.candidates[0][0].block_k)  # one block_k: checks.check_candidates
        a_split = bufs.per_received_row("a_split", (n_recv, hidden), torch.bfloat16)
        gather_split_kernel[(n_recv, 1)](
            data, data.stride(0), scale, scale.stride(0), a_split, a_split.stride(0), hidden,
            A_FMT=fl.a_fmt, BK=bk, NB=triton.next_power_of_2(hidden // bk), SPLIT=fl.mode == "split",
            HW_CVT=fl.use_asm, num_warps=8, **pdl_args(fl.pdl),
        )
        return Operand(a_split, a_split, fl.pairs.weight, fl.a_fmt)
    return Operand(data, scale, fl.pairs.weight, fl.a_fmt)


def k_steps(fl: ForwardLaunch, cfg: TileConfig) -> tuple[int, int]:
    """(GEMM1, GEMM2) K steps: frag8 steps by its weights' K chunk (hidden / intermediate % 128 == 0:
    checked when the weights were re-laid), the others by block_k shrunk to divide K."""
    if fl.mode == "frag8":
        return FP8_K, FP8_K
    if fl.mode == "block_fp8":  # one weight block / A group per step (checks.check_candidates: block_k 128)
        return FP8_BLOCK, FP8_BLOCK
    return reduction_block(fl.weights.hidden, cfg.block_k), reduction_block(fl.weights.intermediate, cfg.block_k)


def a2_buffers(fl: ForwardLaunch, bufs: ForwardBuffers, layout: ExpertLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1's output (A2, one row per layout row): bf16 for the split / frag decoders and bf16 math,
    else the A format (MX per 32, as the reference), which frag8's rowscale_e4m3 then re-scales."""
    rows, inter, e, bm = layout.num_rows, fl.weights.intermediate, fl.weights.num_experts, layout.block_m
    if fl.mode == "block_fp8":  # e4m3 + one fp32 scale per 1 x 128 group (the A format itself)
        return (bufs.per_layout_row("a2", (rows, inter), torch.uint8, e, bm),
                bufs.per_layout_row("a2_g128_scale", (rows, inter // FP8_BLOCK), torch.float32, e, bm))
    if fl.mode in ("split", "frag") or (fl.mode != "frag8" and fl.a_fmt == "bf16"):
        a2 = bufs.per_layout_row("a2", (rows, inter), torch.bfloat16, e, bm)
        return a2, a2
    a2 = bufs.per_layout_row("a2", (rows, inter if fl.a_fmt == "fp8" else inter // 2), torch.uint8, e, bm)
    return a2, bufs.per_layout_row("a2_scale", (rows, inter // MX_BLOCK), torch.uint8, e, bm)


def _common(fl: ForwardLaunch, cfg: TileConfig) -> dict:
    """Compile-time arguments both GEMMs share."""
    return dict(DECODE=fl.mode, USE_ASM=fl.use_asm, BM=cfg.block_m, GROUP_M=cfg.group_m, F32_DOT=interpreting(),
                TAIL_M=cfg.tail_m, TAIL_RIDE=cfg.tail_ride, PERSIST=fl.plan.persist, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, **pdl_args(fl.pdl))


def _live_tiles(fl: ForwardLaunch, layout: ExpertLayout) -> torch.Tensor:
    return layout.live_tiles if layout.live_tiles is not None else fl.pairs.weight


def gemm1(fl: ForwardLaunch, layout: ExpertLayout, cfg: TileConfig, a: Operand, a2: torch.Tensor,
          a2_scale: torch.Tensor) -> None:
    """GEMM1 + SwiGLU (+ clamp) -> A2, one launch per tile pass (gemm1.py)."""
    from .gemm1 import gemm1_swiglu_kernel

    w, inter, limit = fl.weights, fl.weights.intermediate, fl.limit
    w1, w1s, _, _ = weight_operands(w)
    w1_rs = fl.weight_row_scales()[0]
    bk1, bk2 = k_steps(fl, cfg)
    n1 = triton.cdiv(2 * inter, cfg.block_n1)
    cap = fl.plan.gemm_programs(fl.pairs.weight.device, cfg)
    for tile_pass in tile_passes(cfg, fl.mode):
        gemm1_swiglu_kernel[(grid(layout.num_tiles * n1, cap),)](
            layout.tile_expert, layout.sorted_row, layout.num_tiles, _live_tiles(fl, layout), fl.claims,
            a.data, a.data.stride(0), a.scale, a.scale.stride(0),
            w1, w1.stride(0), w1.stride(1), w1s, w1s.stride(0), w1s.stride(1),
            w1_rs, w1_rs.stride(0), a.row_scale,
            a2, a2.stride(0), a2_scale, a2_scale.stride(0),
            w.hidden, inter, float(limit) if limit is not None else 0.0,
            W_FMT=w.fmt, A_FMT=a.fmt, PLAIN=w.gate_up_layout == "plain", HAS_LIMIT=limit is not None,
            BN=cfg.block_n1, BK=bk1, BK2=bk2, PASS=tile_pass, W_FULL=whole_weight_tiles(2 * inter, cfg.block_n1),
            **_common(fl, cfg), **register_cap(cfg, tile_pass, fl.plan.persist),
        )


def a2_operand(fl: ForwardLaunch, layout: ExpertLayout, cfg: TileConfig, a2: torch.Tensor, a2_scale: torch.Tensor,
               bufs: ForwardBuffers, live: LiveRows | None) -> Operand:
    """GEMM2's A operand from GEMM1's A2: frag8 re-scales each MX row to e4m3 over one fp32 scale per
    row (fp8 in place; fp4 into a buffer of its own), split / frag read bf16, the others A2 as written."""
    from .gather import rowscale_e4m3_kernel, rowscale_piece

    if fl.mode == "frag8":
        rows, inter, e = layout.num_rows, fl.weights.intermediate, fl.weights.num_experts
        a2e = a2 if fl.a_fmt == "fp8" else bufs.per_layout_row("a2e", (rows, inter), torch.uint8, e, cfg.block_m)
        a2_rs = bufs.per_layout_row("a2_rs", (rows,), torch.float32, e, cfg.block_m)
        rowscale_e4m3_kernel[(grid(rows, fl.plan.rescale_programs),)](
            layout.sorted_pair, a2, a2.stride(0), a2_scale, a2_scale.stride(0), a2e, a2e.stride(0), a2_rs,
            inter, A_FMT=fl.a_fmt, SORTED=True, NB=triton.next_power_of_2(inter // MX_BLOCK), PK=rowscale_piece(inter),
            HW_CVT=fl.use_asm, num_warps=2, **pdl_args(fl.pdl),
            **({} if live is None else dict(live_ptr=_live_tiles(fl, layout), BM=cfg.block_m, PERSIST=True)),
        )
        return Operand(a2e.view(e4m3_dtype()), a2e, a2_rs, fl.a_fmt)
    if fl.mode in ("split", "frag"):
        return Operand(a2, a2, fl.pairs.weight, "bf16")
    if fl.mode == "block_fp8":
        return Operand(a2.view(e4m3_dtype()), a2_scale, fl.pairs.weight, FP8_G128)
    mx = MXTensor(a2, a2_scale, fl.a_fmt) if fl.a_fmt != "bf16" else a2
    data, scale = operand_pointers(mx, fl.a_fmt, fl.mode == "dot_scaled")
    return Operand(data, scale, fl.pairs.weight, fl.a_fmt)


def dest_args(dest: torch.Tensor | SegmentDest | None, pairs: ExpertPairs) -> tuple[int, torch.Tensor, int, int, int]:
    """GEMM2's (DEST mode, pointer, seg_pairs, seg_row_bytes, DEST_ALIGN) for a destination (gemm2._row_offsets)."""
    if dest is None:
        return 0, pairs.row, 1, 0, 1
    if isinstance(dest, SegmentDest):
        return 2, dest.base, dest.seg_pairs, dest.row_bytes, min(dest.align, DEST_VECTOR_BYTES)
    return 1, dest, 1, 0, 1


def gemm2(fl: ForwardLaunch, layout: ExpertLayout, cfg: TileConfig, a2: Operand, out: torch.Tensor, out_fmt: str,
          dest: torch.Tensor | SegmentDest | None) -> None:
    """GEMM2 x route weight -> each pair's row of ``out`` in ``out_fmt`` (fp32, or the combine wire row
    written by the epilogue), or at its byte offset through ``dest``; one launch per tile pass."""
    from .gemm2 import gemm2_weighted_kernel

    w, hidden = fl.weights, fl.weights.hidden
    _, _, w2, w2s = weight_operands(w)
    w2_rs = fl.weight_row_scales()[1]
    dest_mode, dest_ptr, seg_pairs, seg_row_bytes, dest_align = dest_args(dest, fl.pairs)
    n2 = triton.cdiv(hidden, cfg.block_n2)
    cap = fl.plan.gemm_programs(fl.pairs.weight.device, cfg)
    for tile_pass in tile_passes(cfg, fl.mode):
        gemm2_weighted_kernel[(grid(layout.num_tiles * n2, cap),)](
            layout.tile_expert, layout.sorted_pair, fl.pairs.weight, layout.num_tiles, _live_tiles(fl, layout), fl.claims,
            a2.data, a2.data.stride(0), a2.scale, a2.scale.stride(0),
            w2, w2.stride(0), w2.stride(1), w2s, w2s.stride(0), w2s.stride(1),
            w2_rs, w2_rs.stride(0), a2.row_scale,
            out, out.stride(0) if dest is None else 0, dest_ptr, seg_pairs, seg_row_bytes,
            w.intermediate, hidden,
            W_FMT=w.fmt, A_FMT=a2.fmt, BN=cfg.block_n2, BK=k_steps(fl, cfg)[1], PASS=tile_pass, OUT_FMT=out_fmt,
            W_FULL=whole_weight_tiles(hidden, cfg.block_n2), DEST=dest_mode, DEST_ALIGN=dest_align,
            **_common(fl, cfg), **register_cap(cfg, tile_pass, fl.plan.persist),
        )
