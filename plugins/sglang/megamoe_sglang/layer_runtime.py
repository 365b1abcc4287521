"""Per-layer state of a megamoe_ep FusedMoE: converted weights, runner, MegaMoE runtime.

Weights: SGLang's model loader fills the layer's parameters through the quant method's loaders,
then calls ``quant_method.process_weights_after_loading(layer)``. Under megamoe_ep that call is
redirected (an instance attribute on the quant method, set at layer construction) to convert the
*loaded* tensors to MegaMoE ``ExpertWeights`` and release SGLang's copies — before any vendor
post-processing could reshuffle them for kernels that will never run (Quark MXFP4 preshuffles
for aiter) and without holding the experts twice in memory.

Runner and runtime: built right after the conversion, while the model loads — SGLang's EP group
and expert-location metadata exist by then (ModelRunner.initialize sets both before load_model) —
so the runtime's MTPR-sized arena is allocated before SGLang measures free memory and sizes its
KV cache, and a deployment the layer cannot serve (e.g. an uncapturable forward with CUDA graphs
on) fails at start-up. Kept on the FusedMoE object; the transport underneath is shared by layers
of one shape (core's cache).
"""

from __future__ import annotations

from typing import Any

import torch

from megamoe_backend.layer.eplb import expose_expert_tensors

from .runner import MegaMoEQuantInfo
from .runtime import build_layer_runtime, convert_layer_weights, eplb_metadata, eplb_moves_experts, sglang_ep_group
from .selection import BACKEND_NAME

_EXPERT_PARAMS = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale",
                  "w13_weight_scale_inv", "w2_weight_scale_inv")


def take_over_weights(layer: Any, quant_method: Any) -> None:
    """Redirect ``quant_method.process_weights_after_loading`` for this layer to MegaMoE's conversion."""

    def convert_instead(module: Any) -> None:
        if module is not layer:  # one quant method object per layer in SGLang; be strict anyway
            raise RuntimeError("megamoe_ep: process_weights_after_loading called for a different layer")
        layer._megamoe_weights = convert_layer_weights(layer)
        for name in _EXPERT_PARAMS:
            param = getattr(layer, name, None)
            if isinstance(param, torch.nn.Parameter):
                param.data = param.data.new_empty(0)  # MegaMoE holds its own (converted) copy
        megamoe_runner_for(layer)  # runtime + arena now, before SGLang sizes its KV cache

    quant_method.process_weights_after_loading = convert_instead


def megamoe_runner_for(layer: Any, group: Any = "sglang") -> tuple[Any, MegaMoEQuantInfo]:
    """(runner, quant_info) for ``layer``; ``group`` defaults to SGLang's MoE-EP group."""
    cached = getattr(layer, "_megamoe_ep", None)
    if cached is not None:
        return cached
    from sglang.srt.layers.moe.moe_runner.runner import MoeRunner
    from sglang.srt.layers.moe.utils import resolve_moe_runner_backend

    if group == "sglang":
        group = None if int(layer.moe_ep_size) == 1 else sglang_ep_group()
    runtime = build_layer_runtime(layer, group, eplb=eplb_metadata(layer.moe_runner_config.layer_id))
    runner = MoeRunner(resolve_moe_runner_backend(BACKEND_NAME), layer.moe_runner_config)
    layer._megamoe_ep = (runner, MegaMoEQuantInfo(runtime=runtime))
    # the runtime holds the weights in the layout its experts provider prepared (on CUDA the Triton
    # provider re-lays MXFP4 as MMA fragments: new tensors); the converted copy would double the
    # experts' memory
    layer._megamoe_weights = None
    if eplb_moves_experts():
        expose_for_eplb(layer, runtime)
    return layer._megamoe_ep


def expose_for_eplb(layer: Any, runtime: Any) -> None:
    """Make the layer's expert parameters *be* the tensors MegaMoE computes with.

    SGLang's EPLB moves ``get_moe_weights()`` — every parameter of the FusedMoE with one row per
    local expert, as ``param.data`` — with ``ExpertLocationUpdater`` (torch.distributed P2P into
    temp buffers, then in-place copies). That list is collected lazily (``LazyValue``) at the first
    rebalance, which comes after the model loaded, where this runs.
    """
    scale = "_scale_inv" if getattr(layer, "w13_weight_scale_inv", None) is not None else "_scale"
    expose_expert_tensors(layer, runtime, {"w1": "w13_weight", "w2": "w2_weight",
                                           "w1_scale": f"w13_weight{scale}", "w2_scale": f"w2_weight{scale}"})
