"""Checks of what a Triton experts forward is handed, made before any launch (host facts only:
shapes, dtypes, devices, strides; a value check only where the tensor is on the CPU, so a GPU forward
never synchronises). Every error names the tensor, what it expected and what it got."""

from __future__ import annotations

import torch

from ...formats import MX_BLOCK, GroupFP8Tensor, MXTensor
from ...formats.block_fp8 import FP8_BLOCK
from ..base import Activations, ExpertMath, ExpertPairs
from ..fragments import FP8_K
from ..live import LiveRows, SegmentDest
from ..weights import ExpertWeights
from .config import BLOCK_FP8_GROUP, reduction_block


def check_capacity(pairs: int, capacity: int | None) -> None:
    if capacity is not None and pairs > capacity:
        raise ValueError(
            f"{pairs} routed pairs exceed TritonExperts capacity {capacity} "
            "(MEGA_MAX_TOKENS_PER_RANK x top-k x ep_size); rows are never dropped: raise the capacity"
        )


def check_row_indices(pairs: ExpertPairs, n_recv: int) -> None:
    """pairs.row must index the received rows; checked where it costs no device synchronisation (as
    layout.py does for slots): on CPU tensors. The layer builds its rows itself."""
    p = len(pairs)
    if n_recv == 0:
        raise ValueError(f"{p} routed pairs but no received rows: pairs.row must index the received rows")
    if pairs.row.device.type == "cpu" and (int(pairs.row.min()) < 0 or int(pairs.row.max()) >= n_recv):
        raise ValueError(f"pairs.row out of range [0, {n_recv}) of the received rows: "
                         f"min {int(pairs.row.min())}, max {int(pairs.row.max())}")


def result_buffer(out: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype, device: torch.device,
                   what: str) -> torch.Tensor:
    """The caller's result buffer, checked (contiguous [rows, cols] of dtype on device), or a new one."""
    if out is None:
        return torch.empty(rows, cols, dtype=dtype, device=device)
    if out.shape != (rows, cols) or out.dtype != dtype or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out: expected contiguous {str(dtype).removeprefix('torch.')} [{rows}, {cols}] ({what}) on {device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def wire_target(out: torch.Tensor | None, dest, pairs: int, wire, hidden: int, device: torch.device,
                who: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """A forward_wire call's output, checked: (the uint8 rows it returns, the buffer its last kernel writes,
    that kernel's OUT_FMT "bf16" / "fp8"). ``out``: the caller's rows (a new buffer when None), or with ``dest``
    the flat uint8 base its byte offsets count from; ``who`` names the writer in the refusal of other wires."""
    if wire.mx not in (None, "fp8"):
        raise ValueError(f"combine wire {wire.name!r}: {who} writes bf16 or fp8_blockwise_1x32 rows")
    if dest is None:
        out = result_buffer(out, pairs, wire.row_bytes(hidden), torch.uint8, device,
                            f"{wire.name} combine wire rows at hidden={hidden}")
    else:
        check_dest(dest, out, pairs, device)
    return (out, out.view(torch.bfloat16), "bf16") if wire.mx is None else (out, out, "fp8")


def check_dest(dest: torch.Tensor | SegmentDest, out: torch.Tensor | None, pairs: int, device: torch.device) -> None:
    if out is None or out.dtype != torch.uint8 or not out.is_contiguous() or out.device != device:
        raise ValueError("out: with dest= the base of the destination table must be a contiguous uint8 buffer on "
                         f"{device}, got {None if out is None else (tuple(out.shape), out.dtype, out.device)}")
    if isinstance(dest, SegmentDest):
        base = dest.base
        if base.dtype != torch.int64 or base.dim() != 1 or not base.is_contiguous() or base.device != device:
            raise ValueError(f"dest.base: expected contiguous int64 [segments] byte offsets on {device}, got "
                             f"{tuple(base.shape)} {base.dtype} on {base.device}")
        if dest.seg_pairs < 1 or base.shape[0] * dest.seg_pairs < pairs:
            raise ValueError(f"dest: {base.shape[0]} segments of {dest.seg_pairs} pairs do not cover the {pairs} pairs")
        if dest.align < 1 or dest.align & (dest.align - 1) or dest.row_bytes % dest.align:
            raise ValueError(f"dest.align={dest.align} must be a power of two dividing dest.row_bytes={dest.row_bytes}")
        return
    if dest.dtype != torch.int64 or tuple(dest.shape) != (pairs,) or not dest.is_contiguous() or dest.device != device:
        raise ValueError(f"dest: expected contiguous int64 [{pairs}] byte offsets on {device}, got "
                         f"{tuple(dest.shape)} {dest.dtype} on {dest.device}")


def check_live(live: LiveRows, x, pairs: int, device: torch.device) -> None:
    """LiveRows must tile the received rows into segments, with the pairs in row-major order (k per row)."""
    n_recv = (x.data if isinstance(x, (MXTensor, GroupFP8Tensor)) else x).shape[0]
    c = live.counts
    if c.dtype != torch.int64 or c.dim() != 1 or c.device != device or not c.is_contiguous():
        raise ValueError(f"live.counts: expected contiguous int64 [segments] on {device}, got {tuple(c.shape)} {c.dtype} "
                         f"on {c.device}")
    if live.segments * live.seg_rows != n_recv or n_recv == 0 or pairs % n_recv:
        raise ValueError(f"live: {live.segments} segments x {live.seg_rows} rows must be the {n_recv} received rows, "
                         f"each with the same number of pairs ({pairs} pairs)")


def check_candidates(candidates, mode: str, out_fmt: str, hidden: int, inter: int) -> None:
    """What every tile config of a forward must allow, checked before any launch."""
    for cfg, _ in candidates:
        if out_fmt == "fp8" and cfg.block_n2 < MX_BLOCK:
            raise ValueError(f"the fp8_blockwise_1x32 combine wire is quantised per 1x32 block of a GEMM2 tile: "
                             f"TileConfig.block_n2={cfg.block_n2} must be >= {MX_BLOCK}")
        if mode in ("frag", "frag8") and min(reduction_block(hidden, cfg.block_k), reduction_block(inter, cfg.block_k)) < 64:
            raise ValueError(f"decoder={mode!r} needs block_k >= 64 dividing hidden={hidden} and intermediate={inter}")
        if mode == "frag8" and cfg.block_k < FP8_K:
            raise ValueError(f"decoder='frag8' steps K by {FP8_K} (its weights' K chunk, fragments.fp8_k_order): "
                             f"TileConfig.block_k={cfg.block_k} must be >= {FP8_K}")
    for cfg, _ in candidates:
        if mode == "block_fp8" and (cfg.block_k != BLOCK_FP8_GROUP or cfg.block_n1 % (2 * BLOCK_FP8_GROUP)):
            raise ValueError(f"decoder='block_fp8' steps K by one {BLOCK_FP8_GROUP}-wide weight block / A group and quantises "
                             f"A2 in whole 1x{BLOCK_FP8_GROUP} groups: TileConfig.block_k={cfg.block_k} must be "
                             f"{BLOCK_FP8_GROUP} and block_n1={cfg.block_n1} a multiple of {2 * BLOCK_FP8_GROUP}")
    if mode == "split" and len({cfg.block_k for cfg, _ in candidates}) > 1:
        raise ValueError("decoder='split' lays A out per block_k: the tile config candidates must share block_k")


def has_mx_activations(math: ExpertMath) -> bool:
    """frag8 feeds e4m3 activations to the FP8 tensor cores: only A8W4 / A4W4 have them."""
    return math.a_format in ("fp8", "fp4")


def check_block_fp8_math(weights_fmt: str, math: ExpertMath) -> None:
    """Block-FP8 weights take the fp8_g128 A format (quant=fp8_block) and nothing else does."""
    if (weights_fmt == "fp8_block") != (math.a_format == "fp8_g128"):
        raise ValueError(f"weights fmt={weights_fmt!r} with quant={math.quant}: block-FP8 weights run with quant=fp8_block "
                         "(A in 1x128 groups) and quant=fp8_block needs block-FP8 weights")


def require_mx_activations(math: ExpertMath) -> None:
    if not has_mx_activations(math):
        raise ValueError(f"decoder='frag8' needs MX activations (A8W4 / A4W4); quant={math.quant} has bf16 A")


def received_rows(a: Activations, math: ExpertMath, hidden: int, device: torch.device):
    if isinstance(a, GroupFP8Tensor):
        return _group_rows(a, math, hidden, device)
    if isinstance(a, MXTensor):
        payload = hidden if a.fmt == "fp8" else hidden // 2
        return _quantised_rows(a, math, hidden, device, (payload, torch.uint8), (hidden // MX_BLOCK, torch.uint8))
    if a.dim() != 2 or a.shape[1] != hidden:
        raise ValueError(f"received rows: expected [N, {hidden}], got {tuple(a.shape)}")
    if a.dtype != torch.bfloat16:
        raise ValueError(f"received rows: expected bfloat16 (the bf16 wire), got {a.dtype}")
    if not a.is_contiguous():
        raise ValueError(f"received rows: must be contiguous, got strides {a.stride()} for shape {tuple(a.shape)}")
    if a.device != device:
        raise ValueError(f"received rows: on {a.device}, pairs on {device}")
    return a


def _group_rows(a: GroupFP8Tensor, math: ExpertMath, hidden: int, device: torch.device) -> GroupFP8Tensor:
    """Block-FP8 rows (e4m3 bytes, fp32 scales per 1 x 128 group): views of wire rows are fine (strided rows)."""
    return _quantised_rows(a, math, hidden, device, (hidden, torch.uint8), (hidden // FP8_BLOCK, torch.float32))


def _quantised_rows(a, math: ExpertMath, hidden: int, device: torch.device, data: tuple[int, torch.dtype],
                    scales: tuple[int, torch.dtype]):
    """Quantised received rows ``a`` (MXTensor / GroupFP8Tensor: .fmt, .data, .scales) checked against the experts'
    A format and the (columns, dtype) their data and scales must have; rows may be strided views of wire rows."""
    if a.fmt != math.a_format:
        raise ValueError(f"received {a.fmt} rows but quant={math.quant} needs A operand {math.a_format or 'bf16'} "
                         "(MEGA_DISPATCH_WIRE must match the expert GEMM's A operand)")
    for name, t, (cols, dtype) in (("received rows (data)", a.data, data), ("received rows (scales)", a.scales, scales)):
        if t.dtype != dtype or t.dim() != 2 or t.shape[1] != cols:
            raise ValueError(f"{name}: expected {str(dtype).replace('torch.', '')} [N, {cols}] for hidden={hidden}, got "
                             f"{tuple(t.shape)} {t.dtype}")
        if t.stride(1) != 1:
            raise ValueError(f"{name}: must be contiguous along the hidden dim, got strides {t.stride()}")
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, pairs on {device}")
    if a.data.shape[0] != a.scales.shape[0]:
        raise ValueError(f"received rows: data has {a.data.shape[0]} rows, scales {a.scales.shape[0]}")
    return a


def check_pairs(pairs: ExpertPairs) -> None:
    p = pairs.row.shape[0]
    for name, t, dtype in (("pairs.row", pairs.row, torch.int64), ("pairs.slot", pairs.slot, torch.int64), ("pairs.weight", pairs.weight, torch.float32)):
        if t.dim() != 1 or t.shape[0] != p:
            raise ValueError(f"{name}: expected shape [{p}], got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise ValueError(f"{name}: expected {dtype}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")


def check_weights(w: ExpertWeights, device: torch.device) -> None:
    """ExpertWeights validates shapes at construction; this re-checks what the kernels rely on."""
    e, two_i = w.w1.shape[0], w.w1.shape[1]
    h, i = w.hidden, w.intermediate
    if h % MX_BLOCK or i % MX_BLOCK:
        raise ValueError(f"hidden={h} and intermediate={i} must be multiples of {MX_BLOCK} for the Triton experts")
    if w.fmt == "mxfp4":
        expect = (("w1", w.w1, (e, two_i, h // 2), torch.uint8), ("w1_scale", w.w1_scale, (e, two_i, h // MX_BLOCK), torch.uint8),
                  ("w2", w.w2, (e, h, i // 2), torch.uint8), ("w2_scale", w.w2_scale, (e, h, i // MX_BLOCK), torch.uint8))
    elif w.fmt == "fp8_block":
        b, f8, f32 = FP8_BLOCK, torch.float8_e4m3fn, torch.float32
        expect = (("w1", w.w1, (e, two_i, h), f8), ("w1_scale", w.w1_scale, (e, two_i // b, h // b), f32),
                  ("w2", w.w2, (e, h, i), f8), ("w2_scale", w.w2_scale, (e, h // b, i // b), f32))
    else:
        expect = (("w1", w.w1, (e, two_i, h), torch.bfloat16), ("w2", w.w2, (e, h, i), torch.bfloat16))
    for name, t, shape, dtype in expect:
        if t is None or tuple(t.shape) != shape or t.dtype != dtype:
            got = None if t is None else (tuple(t.shape), t.dtype)
            raise ValueError(f"weights.{name}: expected {dtype} of shape {shape}, got {got}")
        if t.stride(-1) != 1:
            raise ValueError(f"weights.{name}: must be contiguous along K (stride(-1) == 1), got strides {t.stride()}")
        if t.device != device:
            raise ValueError(f"weights.{name}: on {t.device}, pairs on {device}")
