"""The MegaMoE layer (dispatch -> experts -> combine) and top-k routing."""

from .megamoe_layer import MegaMoELayer
from .reference import fp32_reference_moe, rel_l2
from .routing import expert_scores, route

__all__ = ["MegaMoELayer", "expert_scores", "fp32_reference_moe", "rel_l2", "route"]
