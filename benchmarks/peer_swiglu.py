"""DeepSeek's SwiGLU as a fused epilogue of triton_kernels' ``matmul_ogs`` (its ``FusedActivation``).

Why: triton_kernels ships only gpt-oss's SwiGLU (``gate * sigmoid(alpha * gate) * (linear + 1)``, the
``+ 1`` fixed in ``compute_swiglu``), and vLLM's Triton MXFP4 MoE path asserts that activation. DeepSeek
V4's experts compute ``silu(min(gate, L)) * clamp(up, -L, L)`` (experts/base.py), so the peer's GEMM1
gets this epilogue through the hook matmul_ogs offers for it (``FnSpecs`` with ``reduction_n=2``: the
accumulator's even / odd columns are gate / up, the layout of interleaved GEMM1 weights). Imported only
when that peer runs, so nothing else needs Triton's JIT at import time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def deepseek_swiglu(acc, limit):
    gate, up = tl.split(tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)))
    gate = tl.minimum(gate.to(tl.float32), limit)
    up = tl.clamp(up.to(tl.float32), -limit, limit)
    return gate / (1.0 + tl.exp(-gate)) * up


def fused_activation(limit: float | None):
    """matmul_ogs' ``FusedActivation`` for ``deepseek_swiglu`` (no clamp: ``limit`` None -> fp32 max)."""
    from triton_kernels.matmul_ogs import FnSpecs, FusedActivation

    value = float(limit) if limit is not None else 3.4e38
    return FusedActivation(FnSpecs("megamoe_deepseek_swiglu", deepseek_swiglu, ("ds_swiglu_limit",), reduction_n=2), (value,))
