"""Fake aiter.ops.flydsl.moe_common.GateMode (a str Enum in aiter)."""

from enum import Enum


class GateMode(str, Enum):
    SEPARATED = "separated"
    MOCK_GATE_ONLY = "mock_gate_only"
    GATE_ONLY = "gate_only"
    INTERLEAVE = "interleave"
