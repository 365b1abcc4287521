"""Fake-only: what a fused MegaMoE runtime computes for the experts on this rank.

The fakes move no data between ranks, so a fake runtime returns the contributions of its own
experts (all of them at world size 1). Plain fp32 on dequantised MXFP4 weights (e2m1, low nibble
first; E8M0 scales), activations unquantised, SwiGLU with the swiglu_limit clamp. Gate/up rows
arrive GGUU: the fake shuffles hand their input through unchanged. Written independently of
megamoe_backend, which the tests check against it.
"""

import torch

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] + uint8 E8M0 [..., K/32] -> fp32 [..., K]."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    mag = _E2M1[codes & 7]
    val = torch.where((codes & 8) != 0, -mag, mag)
    blocks = val.view(*scale.shape, 32) * torch.exp2(scale.float() - 127).unsqueeze(-1)
    return blocks.flatten(-2)


def local_moe(x, wts, ids, w1, s1, w2, s2, *, rank: int, experts_per_rank: int, swiglu_limit: float) -> torch.Tensor:
    """x [T, H] bf16, rank-major ids [T, k] -> fp32 [T, H] from this rank's experts."""
    e = w1.shape[0]
    w1f = dequant_mxfp4(w1.view(torch.uint8), s1.view(torch.uint8).reshape(e, w1.shape[1], -1))
    w2f = dequant_mxfp4(w2.view(torch.uint8), s2.view(torch.uint8).reshape(e, w2.shape[1], -1))
    xf = x.float()
    out = torch.zeros_like(xf)
    lo = rank * experts_per_rank
    for t, k in torch.nonzero((ids >= lo) & (ids < lo + experts_per_rank)).tolist():
        slot = int(ids[t, k]) - lo
        gate, up = (w1f[slot] @ xf[t]).chunk(2)
        if swiglu_limit > 0:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        out[t] += float(wts[t, k]) * (w2f[slot] @ (torch.nn.functional.silu(gate) * up))
    return out


def fp8_blockwise_1x32(y: torch.Tensor) -> torch.Tensor:
    """fp32 [T, H] through an fp8 e4m3 wire with one power-of-two scale per 1x32 block (what MegaMoEV2's
    fp8_blockwise_1x32 P2P combine carries), back to fp32."""
    t, h = y.shape
    blocks = y.view(t, h // 32, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)))))
    return ((blocks / scale).to(torch.float8_e4m3fn).float() * scale).view(t, h)
