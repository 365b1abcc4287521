"""Peer of the block-FP8 experts (bench_experts --schemes fp8_block): vLLM's Triton ``fused_experts`` with block-FP8
weights (use_fp8_w8a8, block_shape [128, 128]; vllm/model_executor/layers/fused_moe/fused_moe.py).

Why this one: vLLM 0.34's oracle/fp8.py moves Fp8MoeBackend.TRITON to the front on sm_90 for block-FP8 weights
with 1x128 dynamic activations at ep_size 1 (FLASHINFER_CUTLASS at ep_size > 1), so on Hopper this is what vLLM
runs for DeepSeek V3 / R1 FP8 experts when it serves them without expert parallelism, and what it runs when
DeepGEMM / CUTLASS are absent. Its activation quantisation (per_token_group_quant_fp8) is inside the call, as is
the route-weighted sum per token, so its figure covers one more stage (the top-k sum) than the project's experts.

One departure, forced by the carried vLLM (.engine-gpu): vLLM prefers its CUDA op ``_C.per_token_group_fp8_quant``
for that quantisation, and the bundle zeroes that op's sm_90 image (a launch fails with "CUDA error: unknown
error" and poisons the context). The peer makes vLLM's own ``per_token_group_quant_fp8`` take its Triton fallback
(``fp8_utils`` sees a platform that is not CUDA-alike, nothing else changes): the same scales up to one ulp in
about half the groups (it multiplies by fp32(1/448)), a few µs of a different quantisation kernel.

Optional: where vLLM cannot be imported the peer is skipped with the reason (``PeerResult.error``).
"""

from __future__ import annotations

import torch

from .peer_api import PeerResult
from .timing import graph_or_eager, time_fn

NAME = "vllm_triton_block_fp8"


def why_not() -> str | None:
    """None where vLLM's fused_experts and fp8 quant config import, else why not."""
    try:
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config  # noqa: F401
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip, named
        return f"vLLM's fused_experts does not import here: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def run(weights, x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, limit: float | None, of_tokens) -> PeerResult:
    """Time vLLM's block-FP8 fused_experts on ``weights`` (ExpertWeights fmt fp8_block, plain [gate; up] rows, as
    vLLM holds them) for tokens ``x`` routed by ``ids`` / ``route_w`` [T, k]; ``of_tokens``: the bench's per-token
    relL2 against its fp32 reference (TokenCheck.of_tokens)."""
    r = PeerResult(NAME, weights.num_experts, x.shape[0], ids.numel(), scope="fused_experts: A quantisation, both GEMMs, "
                   "SwiGLU, A2 quantisation, route-weighted top-k sum")
    reason = why_not()
    if reason:
        r.error = reason
        return r
    try:
        import vllm
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

        r.version = vllm.__version__
        cfg = fp8_w8a8_moe_quant_config(weights.w1_scale, weights.w2_scale, block_shape=[128, 128],
                                        gemm1_clamp_limit=limit)
        r.config = f"block_shape [128, 128], gemm1_clamp_limit {limit}"
        ids32 = ids.to(torch.int32).contiguous()

        def call():
            return fused_experts(x, weights.w1, weights.w2, route_w.float().contiguous(), ids32, quant_config=cfg,
                                 global_num_experts=weights.num_experts)

        with triton_group_quant():
            y = call()
            r.relL2 = of_tokens(y)
            fn, r.graph = graph_or_eager(call)
            r.us, _ = time_fn(fn, use_graph=False)
        r.config += "; A quantisation: vLLM's Triton per_token_group_quant_fp8 fallback (its CUDA op is not carried)"
    except Exception as exc:  # noqa: BLE001 - a failing peer must not sink the project's sweep
        r.error = f"{type(exc).__name__}: {str(exc)[:400]}"
    return r


class _NotCudaAlike:
    """vLLM's platform with is_cuda_alike / is_xpu False: what fp8_utils.per_token_group_quant_fp8 asks before it
    launches the CUDA op; every other question goes to the real platform."""

    def __init__(self, platform) -> None:
        self._platform = platform

    def is_cuda_alike(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._platform, name)


class triton_group_quant:
    """While open, vLLM's per_token_group_quant_fp8 runs its Triton fallback (module docstring)."""

    def __enter__(self):
        from vllm.model_executor.layers.quantization.utils import fp8_utils

        self._module, self._platform = fp8_utils, fp8_utils.current_platform
        fp8_utils.current_platform = _NotCudaAlike(self._platform)
        return self

    def __exit__(self, *exc) -> None:
        self._module.current_platform = self._platform
