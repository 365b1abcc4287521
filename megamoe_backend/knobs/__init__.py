"""Environment knobs (MEGA_*), read once and validated."""

from .env import (
    COMBINE_WIRE_VALUES,
    DEFAULT_MAX_TOKENS_PER_RANK,
    DISPATCH_WIRE_VALUES,
    KNOB_NAMES,
    TRANSPORT_VALUES,
    KnobError,
    Knobs,
)

__all__ = [
    "COMBINE_WIRE_VALUES",
    "DEFAULT_MAX_TOKENS_PER_RANK",
    "DISPATCH_WIRE_VALUES",
    "KNOB_NAMES",
    "TRANSPORT_VALUES",
    "KnobError",
    "Knobs",
]
