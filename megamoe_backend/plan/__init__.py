"""Plan: spec x knobs x EP position -> a frozen LayerPlan (placement, wires, backends)."""

from .layer_plan import META_BYTES_PER_TOPK, LayerPlan, WireBytes, build_plan, check_wire_matches_quant
from .placement import ExpertPlacement, PlacementError, initial_redundant_map
from .selection import BackendChoice, facts_for, manual_choice, select_for_device

__all__ = [
    "META_BYTES_PER_TOPK",
    "BackendChoice",
    "ExpertPlacement",
    "LayerPlan",
    "PlacementError",
    "WireBytes",
    "build_plan",
    "facts_for",
    "initial_redundant_map",
    "manual_choice",
    "check_wire_matches_quant",
    "select_for_device",
]
