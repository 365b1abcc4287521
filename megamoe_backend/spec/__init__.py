"""Model shapes: MoESpec from config.json, quant scheme detection, named presets."""

from .moe_spec import QUANT_SCHEMES, REQUIRED_KEYS, SCORING_FUNCS, ConfigError, MoESpec, quant_scheme_from_config
from .presets import PRESETS, preset

__all__ = ["PRESETS", "QUANT_SCHEMES", "REQUIRED_KEYS", "SCORING_FUNCS", "ConfigError", "MoESpec", "preset", "quant_scheme_from_config"]
