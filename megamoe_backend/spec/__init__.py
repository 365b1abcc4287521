"""Model shapes: MoESpec from config.json, quant scheme detection (declared, the engine's reading, and what runs), named presets."""

from .engine_reading import EngineReading, EngineRelease, EngineReleaseError, reading_for_config
from .expert_scheme import (SchemeChoice, UnsupportedExpertsError, choose_scheme, describe_scheme, expert_quant_scheme,
                            log_override)
from .moe_spec import (QUANT_SCHEMES, REQUIRED_KEYS, SCORING_FUNCS, ConfigError, MoESpec, check_deepseek_moe,
                       quant_scheme_from_config, read_config, resolve_config_path)
from .presets import PRESET_CONFIGS, PRESETS, preset, preset_config

__all__ = ["PRESETS", "PRESET_CONFIGS", "QUANT_SCHEMES", "REQUIRED_KEYS", "SCORING_FUNCS", "ConfigError", "EngineReading", "EngineRelease",
           "EngineReleaseError", "MoESpec", "SchemeChoice", "UnsupportedExpertsError", "choose_scheme", "describe_scheme",
           "check_deepseek_moe", "expert_quant_scheme", "log_override", "preset", "preset_config", "quant_scheme_from_config",
           "read_config", "reading_for_config", "resolve_config_path"]
