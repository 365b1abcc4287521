"""A layer's MXFP4 or block-FP8 experts in humming-kernels' layout, as the one copy the layer keeps.

Why in place of the row-major weights, not beside them: the weights are most of a layer's memory (DSV4-Pro,
48 experts: 1.6 GB a layer). humming's repacked bytes (4 bits a weight), its folded scale offsets (1 byte
a block) and one bf16 scale per weight row fit ExpertWeights' fields at their shapes (storage "humming"),
so the layer, the memory estimate and an engine's EPLB (``expert_tensors``: every field expert-major) see
the same object as before; the provider views them in humming's shapes at each launch (library.Sublayer).

What the layout holds exactly: humming folds each E8M0 block scale into the weights' e4m3 conversion as
an offset from its row's reference, within 11 binades of the row's largest scale (HUMMING_WINDOW, the
window frag8 folds too: experts/fragments.py FP8_S_MAX). A block further below holding non-zero values
is rescaled and its e2m1 codes rounded by humming (what vLLM runs too); ``rounded_block`` finds the first
such block, and prepare_weights warns naming it, with MEGA_EXPERTS_GEMM=triton as the exact alternative.
"""

from __future__ import annotations

import logging

import torch

from ...formats import MX_BLOCK
from ..weights import ExpertWeights, interleave_gate_up

HUMMING_WINDOW = 11  # binades below a row's largest block scale that humming folds exactly (e4m3 activations)
K_MULTIPLE, N_MULTIPLE = 128, 64  # humming's K tiles and its narrowest N tile, with no padding (padding = 2 copies)
log = logging.getLogger("megamoe")


def check_shape(hidden: int, inter: int) -> None:
    """The shapes humming's GEMMs take without padding the weights (a padded copy would be a second one)."""
    if hidden % K_MULTIPLE or inter % K_MULTIPLE:
        raise ValueError(f"humming experts need hidden and intermediate % {K_MULTIPLE} == 0 (its K tiles, unpadded), got "
                         f"hidden={hidden} intermediate={inter}; set MEGA_EXPERTS_GEMM=triton for these shapes")


def rounded_block(name: str, packed: torch.Tensor, scales: torch.Tensor) -> str | None:
    """The first block humming cannot fold exactly, in words, or None: a block holding a non-zero e2m1 value
    whose scale is more than HUMMING_WINDOW binades below the largest block scale of its row (humming's
    reference: all blocks of the row). ``packed`` uint8 [E, N, K/2] (even K in the low nibble), ``scales``
    uint8 E8M0 [E, N, K/32]."""
    s = scales.to(torch.int32)
    live = ((packed & 0x77) != 0).view(*scales.shape, MX_BLOCK // 2).any(dim=-1)  # 0x77: both codes' magnitudes
    far = live & (s < s.amax(dim=-1, keepdim=True) - HUMMING_WINDOW)
    if not bool(far.any()):
        return None
    e, n, b = (int(i) for i in far.nonzero()[0])
    top = int(s[e, n].max())
    return (f"{name} expert {e} row {n} block {b}: scale 2**{int(s[e, n, b]) - 127}, {top - int(s[e, n, b])} binades "
            f"below the row's 2**{top - 127}")


def to_humming(weights: ExpertWeights, library) -> tuple[ExpertWeights, tuple]:
    """MXFP4 ExpertWeights (any storage but humming's; gate/up interleaved first) or block-FP8 ones (plain rows)
    -> (ExpertWeights in storage "humming", (w13, w2) library.Sublayer). Warns once per tensor where humming
    rounds an MXFP4 block (block-FP8 values are humming's exactly: e4m3 weights, fp32 block scales)."""
    if weights.fmt not in ("mxfp4", "fp8_block"):
        raise ValueError(f"humming experts take MXFP4 or block-FP8 weights, these are {weights.fmt}")
    check_shape(weights.hidden, weights.intermediate)
    if weights.fmt == "fp8_block":
        subs, out = [], []
        for name, w, s in (("w13", weights.w1, weights.w1_scale), ("w2", weights.w2, weights.w2_scale)):
            sub, hw, hs, _ = library.transform_block_fp8(name, w.contiguous(), s.contiguous())
            subs.append(sub)
            out.append((hw, hs))
        (w1h, s1h), (w2h, s2h) = out
        return ExpertWeights(w1h, w2h, "fp8_block", "plain", s1h, s2h, "humming"), tuple(subs)
    src = weights.as_rowmajor()
    w1, s1 = src.w1, src.w1_scale
    if src.gate_up_layout == "plain":
        w1, s1 = interleave_gate_up(w1), interleave_gate_up(s1)
    out, subs = [], []
    for name, w, s in (("w13", w1, s1), ("w2", src.w2, src.w2_scale)):
        where = rounded_block(name, w, s)
        if where is not None:
            log.warning("megamoe: humming-kernels rounds MXFP4 blocks more than %d binades below their row's largest "
                        "scale (first: %s), as vLLM's humming path does; MEGA_EXPERTS_GEMM=triton runs them exactly",
                        HUMMING_WINDOW, where)
        sub, hw, hs, hs2 = library.transform(name, w.contiguous(), s.contiguous())
        out.append((hw, hs, hs2))
        subs.append(sub)
    (w1h, s1h, r1h), (w2h, s2h, r2h) = out
    return ExpertWeights(w1h, w2h, "mxfp4", "interleaved", s1h, s2h, "humming", r1h, r2h), tuple(subs)


__all__ = ["HUMMING_WINDOW", "check_shape", "rounded_block", "to_humming"]
