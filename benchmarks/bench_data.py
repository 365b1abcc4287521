"""The benches' inputs and per-token check: random expert weights in the formats the benches time, routings, and
TokenCheck (relL2 per token against fp32 on the dequantised weights).

Why apart from bench_experts.py: the peers' smoke runs (peer_vllm_humming.py, peer_flashinfer_megamoe.py) use the
same weights, routing and check, and bench_experts imports the peer registry; here they import neither.
"""

from __future__ import annotations

import math as _math

import torch

from megamoe_backend.experts import ExpertPairs, ExpertWeights
from megamoe_backend.formats import MX_BLOCK, dequantize_mx
from megamoe_backend.formats.wire import combine_wire
from megamoe_backend.layer.reference import rel_l2

from .references import token_reference


def make_weights(n_exp: int, hidden: int, inter: int, device: torch.device, seed: int):
    """Random bf16 weights -> MXFP4 (Triton quantiser on GPU, per expert) and their exact bf16 dequantisation."""
    from megamoe_backend.experts.triton.quant import quantize_rows
    from megamoe_backend.formats import quantize_mx

    quantize = quantize_rows if device.type == "cuda" else quantize_mx

    g = torch.Generator(device=device).manual_seed(seed)
    w1q = torch.empty(n_exp, 2 * inter, hidden // 2, dtype=torch.uint8, device=device)
    w1s = torch.empty(n_exp, 2 * inter, hidden // MX_BLOCK, dtype=torch.uint8, device=device)
    w2q = torch.empty(n_exp, hidden, inter // 2, dtype=torch.uint8, device=device)
    w2s = torch.empty(n_exp, hidden, inter // MX_BLOCK, dtype=torch.uint8, device=device)
    w1d = torch.empty(n_exp, 2 * inter, hidden, dtype=torch.bfloat16, device=device)
    w2d = torch.empty(n_exp, hidden, inter, dtype=torch.bfloat16, device=device)
    for e in range(n_exp):
        w1 = (torch.randn(2 * inter, hidden, generator=g, device=device) / _math.sqrt(hidden)).to(torch.bfloat16)
        w2 = (torch.randn(hidden, inter, generator=g, device=device) / _math.sqrt(inter)).to(torch.bfloat16)
        for src, q, s, d in ((w1, w1q, w1s, w1d), (w2, w2q, w2s, w2d)):
            t = quantize(src, "fp4", name="bench weights")
            q[e].copy_(t.data)
            s[e].copy_(t.scales)
            d[e].copy_(dequantize_mx(t).to(torch.bfloat16))
    fp4 = ExpertWeights(w1q, w2q, "mxfp4", "interleaved", w1s, w2s)
    bf16 = ExpertWeights(w1d, w2d, "bf16", "interleaved")
    return fp4, bf16


def make_block_fp8_weights(bf16: ExpertWeights, dequantised: bool = True):
    """The bench's bf16 weights (interleaved gate/up) -> block-FP8 over plain [gate; up] rows (128 x 128 blocks,
    as the checkpoints hold them), and their fp32 dequantisation as the references read weights (fmt "bf16":
    references.LocalExperts widens w1 / w2 as they are), or None with ``dequantised=False`` (the emulated EP
    bench holds every rank's experts and checks no values: 4 bytes a weight it need not hold)."""
    from types import SimpleNamespace

    from megamoe_backend.experts.weights import deinterleave_gate_up
    from megamoe_backend.formats.block_fp8 import dequantize_weight_blocks, quantize_weight_blocks

    w1q = torch.empty(bf16.w1.shape, dtype=torch.float8_e4m3fn, device=bf16.w1.device)
    w2q = torch.empty(bf16.w2.shape, dtype=torch.float8_e4m3fn, device=bf16.w2.device)
    e, two_i, h = bf16.w1.shape
    w1s = torch.empty(e, two_i // 128, h // 128, dtype=torch.float32, device=bf16.w1.device)
    w2s = torch.empty(e, h // 128, two_i // 2 // 128, dtype=torch.float32, device=bf16.w1.device)
    w1d = torch.empty(bf16.w1.shape, dtype=torch.float32, device=bf16.w1.device) if dequantised else None
    w2d = torch.empty(bf16.w2.shape, dtype=torch.float32, device=bf16.w2.device) if dequantised else None
    for i in range(e):  # per expert: the fp32 temporaries of one expert only
        for src, q, s, d in ((deinterleave_gate_up(bf16.w1[i]), w1q, w1s, w1d), (bf16.w2[i], w2q, w2s, w2d)):
            qi, si = quantize_weight_blocks(src.float())
            q[i].copy_(qi)
            s[i].copy_(si)
            if d is not None:
                d[i].copy_(dequantize_weight_blocks(qi, si))
    deq = SimpleNamespace(w1=w1d, w2=w2d, fmt="bf16", gate_up_layout="plain", hidden=h, num_experts=e) if dequantised else None
    return ExpertWeights(w1q, w2q, "fp8_block", "plain", w1s, w2s), deq


def make_routing(tokens: int, n_exp: int, topk: int, hidden: int, device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    ids = torch.rand(tokens, n_exp, generator=g, device=device).topk(topk, dim=1).indices
    w = torch.rand(tokens, topk, generator=g, device=device)
    w = w / w.sum(1, keepdim=True)
    pairs = ExpertPairs(
        row=torch.arange(tokens, device=device).repeat_interleave(topk),
        slot=ids.reshape(-1).contiguous(),
        weight=w.reshape(-1).float().contiguous(),
        per_row=topk,
    )
    return x, pairs


class TokenCheck:
    """relL2 per token of the sampled ``tokens`` against references.token_reference (fp32 on the
    dequantised weights, computed once on first use): of a peer's token rows (``of_tokens``) and of the
    project's pair rows summed per token (``of_pairs``), so the two figures read the same reference."""

    def __init__(self, x: torch.Tensor, pairs: ExpertPairs, wd: ExpertWeights, limit: float | None, tokens: torch.Tensor):
        self.x, self.pairs, self.wd, self.limit, self.tokens = x, pairs, wd, limit, tokens
        self._ref = None

    def reference(self) -> torch.Tensor:
        if self._ref is None:
            t = self.x.shape[0]
            self._ref = token_reference(self.x, self.pairs.slot.view(t, -1), self.pairs.weight.view(t, -1), self.wd,
                                        self.limit, self.tokens)
        return self._ref

    def of_tokens(self, y: torch.Tensor) -> float:
        return rel_l2(y[self.tokens].float(), self.reference())

    def of_pairs(self, y: torch.Tensor, out_fmt: str) -> float:
        rows = torch.nonzero(torch.isin(self.pairs.row, self.tokens)).squeeze(1)
        values = output_values(y[rows], out_fmt, self.wd.hidden)
        sums = torch.zeros(self.tokens.numel(), self.wd.hidden, dtype=torch.float32, device=values.device)
        sums.index_add_(0, torch.searchsorted(self.tokens, self.pairs.row[rows]), values)
        return rel_l2(sums, self.reference())


def output_values(y: torch.Tensor, out_fmt: str, hidden: int) -> torch.Tensor:
    """fp32 values of a forward's output (fp32 rows, or combine wire rows decoded)."""
    return y.float() if out_fmt == "fp32" else combine_wire(out_fmt).decode_fp32(y, hidden)
