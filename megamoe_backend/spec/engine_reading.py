"""The engine's reading of a checkpoint: the activation format an engine release's own quant method names
for MXFP4 routed experts whose config.json names none.

Why: DeepSeek V4's fp4-expert checkpoints (``quant_method: fp8`` + ``expert_dtype: fp4``) say nothing about
the activations. vLLM 0.32 builds their experts as ``Mxfp4MoEMethod(moe)`` (no activation key); vLLM 0.33 and
0.34 build ``Mxfp4MoEMethod(moe, activation_key=kMxfp8Dynamic)`` (``models/deepseek_v4/quant_config.py``
~227 and ``models/deepseek_v41/quant_config.py`` ~261: W4A8, MXFP8 activations, "checkpoint-declared
activation quantization"). SGLang 0.5.23 names MXFP8 activations only for DeepSeek V4.1 on aiter
(``models/deepseek_v4.py`` ~3171: ``experts.fp8_activations = model_type == "deepseek_v41"`` when
``SGLANG_USE_AITER`` on ROCm). MegaMoE serves a checkpoint as the engine it runs in reads it
(``expert_scheme.choose_scheme``). The plugins take the reading from the quant-method objects their engine
built; ``megamoe info`` imports no engine, so it takes it from this module, and
tests/fixtures/quant_scheme_table.json holds both to the same answer per engine release, row by row, on
the real engine classes. Quark checkpoints name their activation format in config.json: no reading here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

ENGINES = ("vllm", "sglang")
# The releases whose sources this table was read against (`megamoe info --engine` accepts any version).
READ_RELEASES = ("vllm-0.32", "vllm-0.33", "vllm-0.34", "sglang-0.5.23")
# model_type values vLLM's DeepseekV4FP8Config claims (override_quantization_method, 0.33 / 0.34).
VLLM_V4_MODEL_TYPES = ("deepseek_v4", "deepseek_v4_text", "deepseek_v41", "deepseek_v41_text")
VLLM_FIRST_MXFP8_RELEASE = (0, 33)  # first vLLM whose V4 quant config passes activation_key=kMxfp8Dynamic
_RELEASE = re.compile(r"^(vllm|sglang)\s*(?:-|==|=|\s)\s*v?(\d+(?:\.\d+){0,2})(?:[.+\-].*)?$", re.IGNORECASE)


class EngineReleaseError(ValueError):
    """An engine release name MegaMoE cannot read (``megamoe info --engine``)."""


@dataclass(frozen=True)
class EngineRelease:
    """One engine release, e.g. vLLM 0.33 (only major.minor[.patch] matter to the readings)."""

    engine: str  # "vllm" | "sglang"
    version: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> "EngineRelease":
        """``vllm-0.33``, ``vllm==0.33.0``, ``sglang-0.5.23`` (a local suffix such as ``+cpu`` is ignored)."""
        m = _RELEASE.match(text.strip())
        if not m:
            raise EngineReleaseError(
                f"--engine {text!r}: expected ENGINE-VERSION with ENGINE one of {' | '.join(ENGINES)}, e.g. "
                f"{', '.join(READ_RELEASES)}"
            )
        return cls(m.group(1).lower(), tuple(int(p) for p in m.group(2).split(".")))

    def __str__(self) -> str:
        return f"{self.engine}-{'.'.join(str(p) for p in self.version)}"


def release_served(release: EngineRelease) -> str | None:
    """Refuse (EngineReleaseError, naming --engine and the fix) a release the plugins do not register on:
    vLLM older than the oldest of READ_RELEASES, SGLang other than the one read; for a vLLM newer than
    the newest read, the note that it is read as that one (the vLLM plugin tries newer releases with a
    warning); else None. The releases are READ_RELEASES: the ones the readings were read against."""
    read = [EngineRelease.parse(r) for r in READ_RELEASES if r.startswith(release.engine)]
    if release.engine == "sglang":
        if release.version not in [r.version for r in read]:
            raise EngineReleaseError(
                f"--engine {release}: the SGLang plugin registers on {', '.join(map(str, read))} only (its hooks are "
                f"checked against exactly that release); pass --engine {read[-1]}")
        return None
    oldest, newest = read[0], read[-1]
    if release.version[:2] < oldest.version:
        raise EngineReleaseError(
            f"--engine {release}: vLLM older than {'.'.join(map(str, oldest.version))} has no --moe-backend megamoe_ep "
            f"(the plugin refuses to register there); pass --engine {oldest} to {newest}, or upgrade vLLM")
    if release.version[:2] > newest.version:
        return (f"--engine {release} is newer than the vLLM releases read ({oldest} to {newest}): read as {newest} "
                "reads it (the plugin tries a newer vLLM after a warning)")
    return None


@dataclass(frozen=True)
class EngineReading:
    """The scheme the engine's own quant method names for the experts, and what named it."""

    scheme: str  # "a8w4" (MXFP8 activations) | "a4w4" (MXFP4 activations)
    source: str  # for the startup line and `megamoe info`, e.g. "vLLM Mxfp4MoEMethod(activation_key=kMxfp8Dynamic)"


def _text_config(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(the text model's config, its quantization_config), as MoESpec.from_config reads them."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    quant = text.get("quantization_config", config.get("quantization_config")) or {}
    return text, quant


def _v4_fp4_experts(text: Mapping[str, Any], quant: Mapping[str, Any], model_types: tuple[str, ...]) -> bool:
    """DeepSeek V4's MXFP4 experts under the fp8 config (NVFP4 experts, `moe_quant_algo`, are another method)."""
    return (
        str(quant.get("quant_method", "")).lower() in ("fp8", "deepseek_v4_fp8")
        and str(text.get("model_type", "")) in model_types
        and str(text.get("expert_dtype") or "fp4").lower() == "fp4"
        and str(quant.get("moe_quant_algo") or "").upper() != "NVFP4"
    )


def reading_for_config(release: EngineRelease | None, config: Mapping[str, Any], device: str,
                       env: Mapping[str, str] | None = None) -> EngineReading | None:
    """What ``release`` reads ``config`` (a config.json mapping) as on ``device``; None: it names no activation
    format (or ``release`` is None: no engine, the checkpoint's own declaration). ``env``: for SGLang's
    ``SGLANG_USE_AITER``."""
    if release is None:
        return None
    text, quant = _text_config(config)
    if release.engine == "vllm":
        if release.version[:2] >= VLLM_FIRST_MXFP8_RELEASE and _v4_fp4_experts(text, quant, VLLM_V4_MODEL_TYPES):
            return EngineReading("a8w4", f"vLLM {'.'.join(map(str, release.version))} DeepseekV4FP8Config: "
                                         "Mxfp4MoEMethod(activation_key=kMxfp8Dynamic)")
        return None
    use_aiter = str((env or {}).get("SGLANG_USE_AITER", "false")).lower() in ("1", "true")
    if device == "rocm" and use_aiter and _v4_fp4_experts(text, quant, ("deepseek_v41",)):
        return EngineReading("a8w4", "SGLang DeepSeek V4.1 on aiter: experts.fp8_activations")
    return None


__all__ = ["ENGINES", "READ_RELEASES", "EngineReading", "EngineRelease", "EngineReleaseError", "reading_for_config",
           "release_served"]
