"""What ``megamoe bench layer`` shares between its three modes: ep_size 1 (bench_layer.py), ``--ep N``
(bench_layer_ep.py) and ``--emulate`` (bench_layer_emulated.py): the schemes and wires, the routing
tensors, the naive torch layer, a long graph's replay time.

Why a module of its own: the three modes imported these from each other (bench_layer dispatches to the
other two, which imported bench_layer back): a circle. Now each imports this, and only bench_layer
imports the other two.
"""

from __future__ import annotations

import statistics

import torch

from megamoe_backend.experts import ExpertWeights, swiglu
from megamoe_backend.knobs import Knobs

SCHEMES = {"a8w4": "fp8", "a4w4": "fp4"}  # quant -> its dispatch wire
# --emulate also runs block-FP8 experts (DeepSeek V3 / R1 FP8 checkpoints) on the fp8_g128 wire, beside DeepGEMM's
# published SM90 MegaMoE per-rank figures (issue 61); the ep_size-1 layer bench runs the MXFP4 schemes.
EMULATED_SCHEMES = {**SCHEMES, "fp8_block": "fp8"}
WEIGHT_FMT_OF = {"a8w4": "mxfp4", "a4w4": "mxfp4", "fp8_block": "fp8_block"}  # quant -> the experts' weight format
COMBINES = ("bf16", "fp8_blockwise_1x32")
CHAIN_LAYERS = 61


class Routes:
    """Static tokens + routing tensors, refilled in place (graphs read their addresses)."""

    def __init__(self, tokens: int, n_exp: int, topk: int, hidden: int, device: torch.device, seed: int) -> None:
        self.g = torch.Generator(device=device).manual_seed(seed)
        self.x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=device)
        self.ids = torch.empty(tokens, topk, dtype=torch.int64, device=device)
        self.w = torch.empty(tokens, topk, dtype=torch.float32, device=device)
        self.n_exp, self.topk = n_exp, topk
        self.refill()

    def refill(self) -> None:
        t = self.x.shape[0]
        self.x.copy_(torch.randn(self.x.shape, generator=self.g, device=self.x.device))
        self.ids.copy_(torch.rand(t, self.n_exp, generator=self.g, device=self.x.device).topk(self.topk, dim=1).indices)
        w = torch.rand(t, self.topk, generator=self.g, device=self.x.device)
        self.w.copy_(w / w.sum(1, keepdim=True))


def naive_torch_layer(x, ids, w, wd: ExpertWeights, limit, rows=None):
    """argsort + gather + two bf16 torch._grouped_mm + SwiGLU + route weight + index_add (capturable).
    ``ids`` / ``w``: [T, k], pair p of token p // k; or, with ``rows`` (the row of ``x`` of each pair), [P]."""
    flat, k = ids.reshape(-1), ids.shape[-1]
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(wd.num_experts, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    src = order // k if rows is None else rows[order]
    h = torch._grouped_mm(x[src], wd.w1.transpose(1, 2), offs=offs)
    act = swiglu(h.float(), wd.gate_up_layout, limit).to(torch.bfloat16)
    y = torch._grouped_mm(act, wd.w2.transpose(1, 2), offs=offs).float() * w.reshape(-1)[order, None]
    return torch.zeros(x.shape[0], wd.hidden, dtype=torch.float32, device=x.device).index_add_(0, src, y).to(torch.bfloat16)


def rms_norm(h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=eps)


def replay_us(graph: torch.cuda.CUDAGraph, n: int = 5) -> float:
    """Median µs of n back-to-back replays of a long graph (after one warm replay)."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def bench_knobs(**fields) -> Knobs:
    """A layer bench's Knobs: the case's wires, capacity and transport, with MEGA_EXPERTS_GEMM read from the
    environment as an engine reads it (Knobs built field by field would leave it "auto", and a run asked for
    humming-kernels would time the Triton GEMMs)."""
    return Knobs(**fields, experts_gemm=Knobs.from_env().experts_gemm)

