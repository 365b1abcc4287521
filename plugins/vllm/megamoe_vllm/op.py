"""``torch.ops.megamoe_vllm.routed_experts``: the MegaMoE call as one opaque op.

Why an op: on CPU vLLM lets Dynamo trace straight into the MoE runner (it skips its own
``moe_forward`` custom op there), and MegaMoE's torch forward (CPU, EP transports) has
data-dependent sizes (per-rank row counts exchanged at run time) that Dynamo cannot put in a graph.
Behind an op with a shape-only fake implementation the compiled graph just calls it. On CUDA at
ep_size 1 the op body is MegaMoE's device forward (no host sync, fixed buffers), so vLLM's CUDA
graphs capture it like any other kernel sequence. Layers are found by name in a per-process table
that each layer fills when its weights are ready.
"""

from __future__ import annotations

from typing import Any

import torch

_RUNTIMES: dict[str, Any] = {}


def register_runtime(layer_name: str, method: Any) -> None:
    _RUNTIMES[layer_name] = method


@torch.library.custom_op("megamoe_vllm::routed_experts", mutates_args=())
def routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer_name: str) -> torch.Tensor:
    try:
        method = _RUNTIMES[layer_name]
    except KeyError:
        raise RuntimeError(f"[megamoe] no MegaMoE runtime for layer {layer_name!r} in this process") from None
    return method.forward_tokens(x, topk_ids, topk_weights)


@routed_experts.register_fake
def _(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty_like(x)
