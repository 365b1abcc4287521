"""Model shapes: MoESpec from config.json, quant scheme detection (declared, and what runs), named presets."""

from .expert_scheme import UnsupportedExpertsError, describe_scheme, expert_quant_scheme
from .moe_spec import QUANT_SCHEMES, REQUIRED_KEYS, SCORING_FUNCS, ConfigError, MoESpec, quant_scheme_from_config
from .presets import PRESETS, preset

__all__ = ["PRESETS", "QUANT_SCHEMES", "REQUIRED_KEYS", "SCORING_FUNCS", "ConfigError", "MoESpec", "UnsupportedExpertsError",
           "describe_scheme", "expert_quant_scheme", "preset", "quant_scheme_from_config"]
