"""MXFP4 routed-expert parameters for when vLLM has no MXFP4 MoE kernel on this platform.

vLLM's Quark OCP-MX MoE method refuses to construct when none of its kernels runs here (on CPU
without amd-quark it finds none), even though MegaMoE would only need the *parameters*. This
object declares them in the layout vLLM's loaders fill for Quark/DeepSeek-V4 MXFP4 checkpoints —
``w13_weight`` [E, 2I, H/2] and ``w2_weight`` [E, H, I/2] uint8, ``w{13,2}_weight_scale`` uint8
E8M0 per 1x32 block (loaded as BLOCK scales) and, for Quark A8W4, the static per-tensor
``w{13,2}_input_scale`` (loaded, not used: MegaMoE's A8W4 scales activations per 1x32 block).
It computes nothing; ``MegaMoEMethod`` converts the loaded tensors and runs them.
"""

from __future__ import annotations

from typing import Any

import torch

MX_BLOCK = 32


class MXFP4ExpertParams:
    """Stand-in for vLLM's MXFP4 MoE quant method: parameters only. ``quant``: "a4w4" | "a8w4", the
    parameter layout the checkpoint declares; ``activation_key``: the activation format vLLM's own
    method was given (``Mxfp4MoEMethod(activation_key=...)``, kept so the engine's reading survives
    the method vLLM could not build here), None where it was given none."""

    weight_dtype = "mxfp4"

    def __init__(self, quant: str, activation_key: object = None) -> None:
        if quant not in ("a4w4", "a8w4"):
            raise ValueError(f"quant={quant!r}; expected a4w4 or a8w4")
        self.quant = quant
        self.activation_key = activation_key

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        from vllm.model_executor.utils import set_weight_attrs

        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        if h % MX_BLOCK or i % MX_BLOCK:
            raise ValueError(f"MXFP4 experts need hidden ({h}) and intermediate ({i}) sizes % {MX_BLOCK} == 0")
        attrs = dict(extra_weight_attrs, quant_method="block")
        shapes = {
            "w13_weight": (e, 2 * i, h // 2),
            "w2_weight": (e, h, i // 2),
            "w13_weight_scale": (e, 2 * i, h // MX_BLOCK),
            "w2_weight_scale": (e, h, i // MX_BLOCK),
        }
        for name, shape in shapes.items():
            p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.uint8), requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, attrs)
        if self.quant == "a8w4":
            for name in ("w13_input_scale", "w2_input_scale"):
                p = torch.nn.Parameter(torch.ones(e, dtype=torch.float32), requires_grad=False)
                layer.register_parameter(name, p)
                set_weight_attrs(p, attrs)
