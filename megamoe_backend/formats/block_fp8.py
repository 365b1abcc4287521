"""Block-FP8 (DeepSeek V3 / R1 FP8 checkpoints): e4m3 weights in 128x128 blocks, activations in 1x128 groups.

Why its own module: the scales are fp32 and not powers of two, so nothing of the MX code (E8M0 scales,
32-wide blocks) applies. The torch code here is the CPU path and the yardstick for any later kernel.

- Weights, as the checkpoints store them: ``weight`` float8_e4m3fn [..., N, K] and ``weight_scale_inv``
  fp32 [..., N / 128, K / 128]; value = q * scale_inv of its 128 x 128 block. MegaMoE needs N and K to be
  multiples of 128 (DeepSeek V3: 7168, 2048), which is what vLLM's Fp8MoEMethod needs of the experts too.
- Activations, as vLLM's ``per_token_group_quant_fp8`` computes them on CUDA (0.34's ``fp8_utils.py`` prefers
  the C++ kernel ``per_token_group_fp8_quant``, csrc/quantization/w8a8/fp8/per_token_group_quant.cu, use_ue8m0
  off): per row and 128-wide group, scale = max(amax, 1e-10) / 448 in fp32 -- NOT rounded to a power of two --
  and q = clamp(x / scale, -448, 448) rounded to e4m3 (RNE). vLLM's Triton fallback (non-contiguous input,
  other platforms) multiplies amax by fp32(1 / 448) instead, one ulp of the scale apart in about half the
  groups. Non-finite input differs on purpose: the C++ kernel's fmaxf drops NaN from amax and its clamp turns
  a NaN element into -448; here a group holding NaN/Inf gets a NaN/Inf scale, so the damage stays visible,
  in that group of that row (the layer's rule for bad rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_BLOCK = 128  # weight block edge and activation group width
E4M3_MAX = 448.0
GROUP_EPS = 1e-10  # vLLM's eps: an all-zero group gets scale 1e-10 / 448, never 0
A_FORMAT = "fp8_g128"  # the A operand's name beside the MX ones ("fp8", "fp4")


class BlockFP8Error(ValueError):
    """A tensor is not in the block-FP8 layout (named in the message)."""


@dataclass(frozen=True)
class GroupFP8Tensor:
    """Activations in the block-FP8 A format: e4m3 bytes plus one fp32 scale per 1 x 128 group."""

    data: torch.Tensor  # uint8 [..., K], the e4m3fn bit patterns
    scales: torch.Tensor  # fp32 [..., K // 128]
    fmt: str = A_FORMAT

    def dequantize(self) -> torch.Tensor:
        return dequantize_groups(self)


def _check_multiple(size: int, name: str, what: str) -> None:
    if size % FP8_BLOCK:
        raise BlockFP8Error(f"{name}: {what} {size} is not a multiple of {FP8_BLOCK}; block-FP8 experts need whole "
                            f"{FP8_BLOCK}x{FP8_BLOCK} weight blocks and 1x{FP8_BLOCK} activation groups")


def group_scales(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax per group -> fp32 scale, exactly as vLLM's CUDA kernel: max(amax, eps) / 448."""
    amax = torch.clamp(amax.to(torch.float32), min=GROUP_EPS)
    # divided by a tensor, not the Python float: on CUDA torch turns "/ scalar" into "* (1 / scalar)", an ulp off
    # the IEEE quotient in about half the groups (measured on an H100), which the CUDA kernel does not do
    return amax / torch.full_like(amax, E4M3_MAX)


def _to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    return torch.clamp(scaled, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_groups(x: torch.Tensor, name: str = "x") -> GroupFP8Tensor:
    """x [..., K] -> e4m3 with one fp32 scale per 1 x 128 group along K."""
    _check_multiple(x.shape[-1], name, "last dimension")
    xf = x.to(torch.float32)
    groups = xf.reshape(*xf.shape[:-1], xf.shape[-1] // FP8_BLOCK, FP8_BLOCK)
    scales = group_scales(groups.abs().amax(dim=-1))
    q = _to_e4m3(groups / scales.unsqueeze(-1)).reshape(xf.shape)
    return GroupFP8Tensor(q.view(torch.uint8), scales)


def dequantize_groups(t: GroupFP8Tensor) -> torch.Tensor:
    """GroupFP8Tensor -> fp32 [..., K]."""
    values = t.data.view(torch.float8_e4m3fn).to(torch.float32)
    groups = values.reshape(*values.shape[:-1], values.shape[-1] // FP8_BLOCK, FP8_BLOCK)
    return (groups * t.scales.to(torch.float32).unsqueeze(-1)).reshape(values.shape)


def fake_quantize_groups(x: torch.Tensor) -> torch.Tensor:
    """Quantise-dequantise round trip in fp32 (what the A operand sees)."""
    return dequantize_groups(quantize_groups(x))


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """[..., N, K] -> [..., N/128, 128, K/128, 128]."""
    *lead, n, k = w.shape
    return w.reshape(*lead, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)


def quantize_weight_blocks(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (float8_e4m3fn [..., N, K], weight_scale_inv fp32 [..., N/128, K/128]): one scale per
    128 x 128 block, amax / 448 (how the tests make checkpoints; only the dequantisation below must match)."""
    _check_multiple(w.shape[-2], name, "rows (N)")
    _check_multiple(w.shape[-1], name, "columns (K)")
    b = _blocks(w.to(torch.float32))
    scale_inv = group_scales(b.abs().amax(dim=(-3, -1)))
    q = _to_e4m3(b / scale_inv[..., :, None, :, None]).reshape(w.shape)
    return q, scale_inv


def check_weight_scale(w: torch.Tensor, scale_inv: torch.Tensor | None, name: str) -> None:
    """``scale_inv`` must be fp32 with one scale per 128 x 128 block of ``w``; per-tensor scales (a checkpoint
    without ``weight_block_size``) and other block sizes are refused naming the tensor."""
    if w.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise BlockFP8Error(f"{name} must be float8_e4m3fn (or its uint8 bytes) for block-FP8 experts, got {w.dtype}")
    *lead, n, k = w.shape
    _check_multiple(n, name, "rows (N)")
    _check_multiple(k, name, "columns (K)")
    expect = (*lead, n // FP8_BLOCK, k // FP8_BLOCK)
    scale_name = f"{name}_scale_inv"
    if scale_inv is None:
        raise BlockFP8Error(f"{scale_name} is missing: block-FP8 experts need one fp32 scale per 128x128 block")
    got = tuple(scale_inv.shape)
    if got != expect:
        # one scale per tensor (per expert), or fewer dims than a block grid (vLLM's per-tensor [E, 2]: gate, up)
        per_tensor = scale_inv.numel() == (lead[0] if lead else 1) or scale_inv.dim() < len(lead) + 2
        kind = ("per-tensor FP8 scales (a checkpoint without weight_block_size) are not served"
                if per_tensor else f"that is not one scale per {FP8_BLOCK}x{FP8_BLOCK} block")
        raise BlockFP8Error(f"{scale_name} has shape {got}, expected {expect} for {name} {tuple(w.shape)}: {kind}; "
                            f"MegaMoE serves block-FP8 with weight_block_size [{FP8_BLOCK}, {FP8_BLOCK}] only")
    if scale_inv.dtype != torch.float32:
        raise BlockFP8Error(f"{scale_name} must be float32, got {scale_inv.dtype}")


def dequantize_weight_blocks(w: torch.Tensor, scale_inv: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """(e4m3 [..., N, K], scale_inv [..., N/128, K/128]) -> fp32 [..., N, K]."""
    check_weight_scale(w, scale_inv, name)
    values = w.view(torch.float8_e4m3fn).to(torch.float32)
    return (_blocks(values) * scale_inv[..., :, None, :, None]).reshape(values.shape)


def check_weight_block_size(block: object, where: str) -> None:
    """A checkpoint's ``weight_block_size`` must be [128, 128]; None means per-tensor FP8 scales."""
    if block is None:
        raise BlockFP8Error(f"{where}: quant_method fp8 without weight_block_size (per-tensor FP8 scales) is not served; "
                            f"MegaMoE serves block-FP8 experts with weight_block_size [{FP8_BLOCK}, {FP8_BLOCK}]")
    if [int(b) for b in block] != [FP8_BLOCK, FP8_BLOCK]:  # type: ignore[union-attr]
        raise BlockFP8Error(f"{where}: weight_block_size {list(block)} is not served; MegaMoE serves block-FP8 "  # type: ignore[call-overload]
                            f"experts with weight_block_size [{FP8_BLOCK}, {FP8_BLOCK}] only")
