"""Peer of the block-FP8 experts (bench experts --schemes fp8_block --peers deepgemm_block_fp8): DeepGEMM's m-grouped
FP8 GEMMs, the SM90 "1D2D" kernels (e4m3 A with one fp32 scale per 1 x 128 group, e4m3 B with one fp32 scale per
128 x 128 block, bf16 out), in the contiguous layout.

Why this one: it is the grouped GEMM the engines reach for block-FP8 experts when DeepGEMM is installed. vLLM 0.34
runs it as ``TritonOrDeepGemmExperts`` with ``VLLM_USE_DEEP_GEMM=1`` or ``--moe-backend deep_gemm``
(``fused_moe/oracle/fp8.py``; its Hopper defaults are Triton at ep_size 1 and FlashInfer CUTLASS under EP),
and SGLang's DeepEP normal-mode runner feeds its received rows to ``m_grouped_fp8_gemm_nt_contiguous``. Neither
engine's DeepGEMM build runs on the device (vLLM's vendored copy has no compiled extension there): this peer runs
DeepGEMM built from source on the GPU machine (``benchmarks/research/deepgemm_bundle.py`` / ``deepgemm_setup.sh``).

What is DeepGEMM's and what is not: both GEMMs and DeepGEMM's own ``per_token_cast_to_fp8`` (1 x 128 groups, fp32
scales) are the library's. The rest of the call is this peer's torch: the layout (computed on the host when a
routing is bound, as DeepEP's normal dispatch hands its receiver per-expert counts on the host; each expert's rows
padded to DeepGEMM's M alignment, pad rows marked -1 and never read back), the row gather, SwiGLU with the clamp
then the A2 quantisation (vLLM fuses those two in one Triton kernel), the route-weighted sum. So the whole call is
an upper bound on an engine's glue around these GEMMs; ``stages_us`` times GEMM1 and GEMM2 alone on the bound
rows (CUDA-graph replays), the figure to set beside the project's experts.

Optional: where ``deep_gemm`` does not import (no build on this host, no sm_90) the peer is skipped with the reason.
"""

from __future__ import annotations

import torch

from .peer_api import Peer, PeerUnavailable, require_cuda
from .timing import graph_or_eager, time_fn

NAME = "deepgemm_block_fp8"
GROUP = 128  # the activation group and the weight block edge of the scheme
SETUP = "eval \"$(bash benchmarks/research/deepgemm_setup.sh .deepgemm)\" (carry .deepgemm: deepgemm_bundle.py)"


def make_peer() -> Peer:
    """The peer, or PeerUnavailable naming why it cannot run here."""
    device = require_cuda(NAME)
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        raise PeerUnavailable(f"{NAME}: sm_{major}{minor}; the peer times DeepGEMM's SM90 1D2D kernels")
    try:
        import deep_gemm
        from deep_gemm.utils import per_token_cast_to_fp8
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason to skip
        raise PeerUnavailable(f"{NAME}: import deep_gemm failed ({type(exc).__name__}: {str(exc)[:200]}); "
                              f"on the GPU machine: {SETUP}") from None
    return DeepGemmBlockFp8(deep_gemm, per_token_cast_to_fp8, device)


class DeepGemmBlockFp8(Peer):
    name = NAME
    weights_fmt = "fp8_block"

    def __init__(self, dg, cast, device: torch.device) -> None:
        super().__init__()
        self.dg, self.cast, self.device = dg, cast, device
        self.version = f"deep_gemm {getattr(dg, '__version__', '?')}"
        self.align = int(dg.get_mk_alignment_for_contiguous_layout())
        self.config = (f"m_grouped_fp8_gemm_nt_contiguous (SM90 1D2D, fp32 scales, m_indices layout, M alignment "
                       f"{self.align}), JIT-compiled with the machine's NVCC on first use; one CUDA graph")
        self.scope = ("whole MoE call: A 1x128 quant (deep_gemm.utils.per_token_cast_to_fp8) + row gather + GEMM1 + "
                      "SwiGLU(limit) + A2 quant + GEMM2 + route-weighted sum (bf16 token rows in and out); the "
                      "layout is made on the host at bind, as DeepEP's normal dispatch gives it")
        self.w = None
        self.bound: dict = {}  # the last bound call's buffers and steps (stages_us times its GEMMs alone)

    def release(self) -> None:
        self.w, self.bound, self.loaded_key = None, {}, None

    def load(self, weights, shape, *, max_tokens, ep_size=1, ep_rank=0):
        from .peer_api import weights_key

        if weights.fmt != "fp8_block" or weights.gate_up_layout != "plain":
            raise ValueError(f"{NAME}: block-FP8 weights over plain [gate; up] rows, not {weights.fmt} / "
                             f"{weights.gate_up_layout}")
        if shape.hidden % GROUP or shape.intermediate % GROUP:
            raise ValueError(f"{NAME}: hidden {shape.hidden} / intermediate {shape.intermediate} not multiples of {GROUP}")
        self.experts, self.shape, self.ep_size, self.ep_rank = weights.num_experts, shape, ep_size, ep_rank
        key = weights_key(weights)
        if key == self.loaded_key and self.w is not None:
            return
        w = weights.to(self.device)  # DeepGEMM reads the checkpoint's own tensors: [E, N, K] e4m3, [E, N/128, K/128]
        self.w = ((w.w1.contiguous(), w.w1_scale.float().contiguous()),
                  (w.w2.contiguous(), w.w2_scale.float().contiguous()))
        self.loaded_key = key

    def _layout(self, ids: torch.Tensor):
        """Host-side contiguous layout of this routing's local pairs: the source (token, slot) of each row, each
        row's expert (-1 for pad rows) and the row of each pair (-1 for pairs of other ranks)."""
        t, k = ids.shape
        local = ids.to(torch.int64) - self.ep_rank * self.experts
        flat = local.view(-1).cpu()
        ok = (flat >= 0) & (flat < self.experts)
        counts = torch.bincount(flat[ok], minlength=self.experts)
        padded = (counts + self.align - 1) // self.align * self.align
        starts = torch.cumsum(padded, 0) - padded
        rows = max(int(padded.sum()), self.align)  # no pair here: one pad block, every row -1
        pairs = torch.nonzero(ok).view(-1)
        order = torch.argsort(flat[pairs], stable=True)  # the local pairs by expert, in token order within one
        by_expert, expert = pairs[order], flat[pairs][order]
        first = torch.cumsum(counts, 0) - counts  # where each expert's pairs start in that order
        row_of_pair = torch.full((t * k,), -1, dtype=torch.int64)
        row_of_pair[by_expert] = starts[expert] + torch.arange(by_expert.numel()) - first[expert]
        m_indices = torch.full((rows,), -1, dtype=torch.int32)
        m_indices[row_of_pair[pairs]] = flat[pairs].to(torch.int32)
        src = torch.zeros(rows, dtype=torch.int64)
        src[row_of_pair[pairs]] = pairs // k
        return rows, m_indices.to(self.device), row_of_pair.to(self.device), src.to(self.device)

    def bind(self, x, ids, weights):
        dg, cast, dev = self.dg, self.cast, self.device
        (w1, s1), (w2, s2) = self.w
        t, k = ids.shape
        hidden, inter = self.shape.hidden, self.shape.intermediate
        limit = self.shape.swiglu_limit
        rows, m_indices, row_of_pair, src = self._layout(ids)
        x = x.contiguous()
        route_w = weights.float().view(-1)
        live = row_of_pair >= 0
        pair_rows = torch.where(live, row_of_pair, torch.zeros_like(row_of_pair))
        h1 = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, device=dev)
        y2 = torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev)

        def gemm1(a1q, a1s):
            dg.m_grouped_fp8_gemm_nt_contiguous((a1q, a1s), (w1, s1), h1, m_indices, disable_ue8m0_cast=True)

        def gemm2(a2q, a2s):
            dg.m_grouped_fp8_gemm_nt_contiguous((a2q, a2s), (w2, s2), y2, m_indices, disable_ue8m0_cast=True)

        def act_quant():
            gate, up = h1.float().chunk(2, dim=-1)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            return cast((torch.nn.functional.silu(gate) * up).to(torch.bfloat16), use_ue8m0=False, gran_k=GROUP)

        def call():
            xq, xs = cast(x, use_ue8m0=False, gran_k=GROUP)
            gemm1(xq[src], xs[src])
            gemm2(*act_quant())
            pair_out = torch.where(live.unsqueeze(1), y2[pair_rows].float() * route_w.unsqueeze(1), 0.0)
            return pair_out.view(t, k, hidden).sum(1).to(torch.bfloat16)

        self.bound = {"x": x, "src": src, "gemm1": gemm1, "gemm2": gemm2, "act_quant": act_quant, "rows": rows}
        return call

    def tactic(self, tokens: int) -> str:
        rows = self.bound.get("rows") if self.bound else None
        return "" if rows is None else f"{rows} rows (each expert's padded to {self.align})"

    def stages_us(self, x: torch.Tensor) -> dict:
        """GEMM1 and GEMM2 alone on the bound rows, each its own CUDA graph timed as the whole call (after it ran,
        so no JIT is inside); their inputs made once outside the timed replays."""
        b = self.bound
        if not b:
            return {}
        xq, xs = self.cast(b["x"], use_ue8m0=False, gran_k=GROUP)
        a1 = (xq[b["src"]].contiguous(), xs[b["src"]].contiguous())
        b["gemm1"](*a1)
        a2 = b["act_quant"]()
        out = {}
        for name, fn in (("gemm1", lambda: b["gemm1"](*a1)), ("gemm2", lambda: b["gemm2"](*a2))):
            timed, _ = graph_or_eager(fn)
            out[name], _ = time_fn(timed, use_graph=False)
        return out
