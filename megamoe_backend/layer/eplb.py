"""Hand a layer's expert tensors to an engine's EPLB: the engine's module parameters *become* them.

Why: vLLM (``get_expert_weights``) and SGLang (``get_moe_weights``) rebalance by moving every
per-expert parameter of the MoE module between ranks in place. MegaMoE computes with its own,
provider-prepared tensors; pointing the module's parameters at exactly those tensors makes the
engine's move code move MegaMoE's experts (scales and row scales included), with no second copy
and nothing to re-sync afterwards (``MegaMoELayer.expert_tensors`` stops the provider caching).
"""

from __future__ import annotations

from typing import Any

import torch

# ExpertWeights fields with no engine parameter of their own (frag8 row scales): registered under these
EXTRA_PARAMS = {"w1_row_scale": "w13_megamoe_row_scale", "w2_row_scale": "w2_megamoe_row_scale"}


def expose_expert_tensors(module: torch.nn.Module, layer: Any, param_names: dict[str, str]) -> list[str]:
    """Point ``module``'s parameters at ``layer.expert_tensors()``; ``param_names`` maps ExpertWeights
    fields to the engine's parameter names (fields it does not name go to EXTRA_PARAMS names, as new
    parameters). Returns the parameter names set, in field order."""
    names = []
    for field, tensor in layer.expert_tensors().items():
        name = param_names.get(field) or EXTRA_PARAMS[field]
        param = getattr(module, name, None)
        if isinstance(param, torch.nn.Parameter):
            param.data = tensor
        else:
            module.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
        names.append(name)
    return names
