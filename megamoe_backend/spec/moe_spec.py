"""MoE model shapes and quant scheme, read from a Hugging Face ``config.json``.

Why a spec object: every later layer (knobs validation, plan, wire sizes, plugins) needs the same
dozen numbers, and reading them in one place means a missing key fails once, at startup, with the
key's name, rather than as a shape error deep inside a kernel.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from ..formats.block_fp8 import BlockFP8Error, check_weight_block_size

SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
QUANT_SCHEMES = ("bf16", "fp8_block", "a8w4", "a4w4")
# quant scheme -> format of the A operand (None: bf16 activations): MX "fp8" / "fp4" (one E8M0 scale per 1x32),
# or "fp8_g128" (block-FP8: e4m3 with one fp32 scale per 1x128 group, formats/block_fp8.py). Here, beside the
# schemes, so the spec (which reads schemes) and the experts (which compute them) both read it without
# importing each other.
A_OPERAND = {"bf16": None, "fp8_block": "fp8_g128", "a8w4": "fp8", "a4w4": "fp4"}
# A format -> the MEGA_DISPATCH_WIRE value that carries it: "fp8" means the GEMM's own fp8 A format, MX rows
# for a8w4 and 1x128-group rows for fp8_block, so a quantised wire is never re-quantised on the receiver.
WIRE_OF_A_FORMAT = {"fp8": "fp8", "fp4": "fp4", "fp8_g128": "fp8"}

# Keys without which the MoE layer cannot be built. Everything else has a documented default.
REQUIRED_KEYS = ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")


class ConfigError(ValueError):
    """config.json cannot describe a MegaMoE layer (missing key, unsupported value)."""


@dataclass(frozen=True)
class MoESpec:
    """The routed-experts shape of one DeepSeek-style model, plus its routing and quant scheme."""

    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    num_hidden_layers: int = 1
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    swiglu_limit: float | None = None
    quant: str = "bf16"
    model_type: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func={self.scoring_func!r} is not supported; expected one of {SCORING_FUNCS}")
        if self.quant not in QUANT_SCHEMES:
            raise ConfigError(f"quant scheme {self.quant!r}; expected one of {QUANT_SCHEMES}")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..n_routed_experts={self.n_routed_experts}"
            )
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_group={self.n_group} must divide n_routed_experts={self.n_routed_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}")

    @property
    def num_moe_layers(self) -> int:
        return max(0, self.num_hidden_layers - self.first_k_dense_replace)

    def scaled(self, **overrides: Any) -> "MoESpec":
        """A copy with some fields replaced (demo and tests shrink the real shapes)."""
        return replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | str | Path, name: str = "") -> "MoESpec":
        """Build from a config.json mapping, its path or its checkpoint folder (a nested ``text_config``
        is used when present)."""
        where = "config.json"
        if isinstance(config, (str, Path)):
            path = resolve_config_path(config)
            config, where = read_config(path), str(path)
            name = name or path.parent.name or path.stem
        cfg = dict(config)
        quant_cfg = cfg.get("quantization_config")
        if isinstance(cfg.get("text_config"), Mapping):
            text = dict(cfg["text_config"])
            quant_cfg = text.get("quantization_config", quant_cfg)
            cfg = text
        check_deepseek_moe(cfg, where)
        n_group = cfg.get("n_group") or 1
        topk_group = cfg.get("topk_group") or 1
        limit = cfg.get("swiglu_limit")
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            n_routed_experts=int(cfg["n_routed_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            num_hidden_layers=int(cfg.get("num_hidden_layers") or 1),
            n_group=int(n_group),
            topk_group=int(topk_group),
            scoring_func=str(cfg.get("scoring_func") or "softmax"),
            topk_method=str(cfg.get("topk_method") or "greedy"),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            swiglu_limit=float(limit) if limit else None,
            quant=quant_scheme_from_config(quant_cfg, cfg.get("expert_dtype"), str(cfg.get("model_type") or "")),
            model_type=str(cfg.get("model_type") or ""),
            name=name,
        )


# Routed-expert counts other MoE families name (Qwen2/3-MoE, OLMoE: num_experts; Mixtral, Llama 4, GPT-OSS:
# num_local_experts; ...): a config with one of them but no n_routed_experts is a MoE MegaMoE does not model.
OTHER_MOE_EXPERT_KEYS = ("num_experts", "num_local_experts", "moe_num_experts", "n_experts", "num_routed_experts")
CONFIG_HINT = "point --model at the checkpoint's config.json (or a local folder holding one)"


def resolve_config_path(model: str | Path) -> Path:
    """The config.json that ``model`` names: the file itself, or ``<folder>/config.json``.

    Why here: ``megamoe info --model`` takes either, and a Hugging Face id (``deepseek-ai/DeepSeek-V4-Pro``)
    is not downloaded: the error says which path was tried and how to point at a config.json.
    """
    path = Path(model)
    if path.is_dir():
        candidate = path / "config.json"
        if not candidate.is_file():
            raise ConfigError(f"no config.json in the folder {path} (tried {candidate}); {CONFIG_HINT}")
        return candidate
    if not path.exists():
        looks_like_id = not path.is_absolute() and len(path.parts) == 2 and not path.suffix
        hint = (f"{model!r} looks like a Hugging Face model id, which is not downloaded here: fetch its config.json "
                f"(e.g. `huggingface-cli download {model} config.json --local-dir DIR`) and pass DIR, or "
                if looks_like_id else "")
        raise ConfigError(f"config file not found: tried {path.resolve()}; {hint}{CONFIG_HINT}")
    return path


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``; an unreadable file or bad JSON is a ConfigError naming the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}; {CONFIG_HINT}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                          f"{CONFIG_HINT}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not an object; {CONFIG_HINT}")
    return config


def check_deepseek_moe(cfg: Mapping[str, Any], where: str = "config.json") -> None:
    """Refuse what is not a DeepSeek-style MoE config, saying which kind of model it is.

    A dense model (Llama: no expert keys at all) and another MoE family (Qwen3-MoE's ``num_experts``,
    Mixtral's ``num_local_experts``) are named as such; a DeepSeek config missing a key names the key.
    """
    model_type = str(cfg.get("model_type") or "?")
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if not missing:
        return
    if "n_routed_experts" in missing:
        other = [k for k in OTHER_MOE_EXPERT_KEYS if k in cfg]
        if other:
            raise ConfigError(
                f"{where}: model_type={model_type!r} is a MoE model ({other[0]}={cfg[other[0]]}) but not a "
                "DeepSeek-style one: only DeepSeek-style MoE (n_routed_experts, DeepSeek V3 / R1 / V4 routing) is "
                "supported; serve it with the engine's own MoE backend"
            )
        if not any(k in cfg for k in ("moe_intermediate_size", "num_experts_per_tok")):
            raise ConfigError(
                f"{where}: model_type={model_type!r} is not a MoE model (no routed experts: n_routed_experts, "
                "moe_intermediate_size and num_experts_per_tok are absent); MegaMoE serves DeepSeek-style MoE layers "
                "only: serve it without --moe-backend megamoe_ep / --moe-a2a-backend megamoe_ep"
            )
    raise ConfigError(f"{where} (model_type={model_type!r}) is missing required MoE key(s): {', '.join(missing)}; "
                      "a DeepSeek-style MoE config has all of " + ", ".join(REQUIRED_KEYS))


def quant_scheme_from_config(quant_cfg: Mapping[str, Any] | None, expert_dtype: Any = None, model_type: str = "") -> str:
    """``quantization_config`` (+ the model's ``expert_dtype``) -> the routed experts' declared scheme:
    "bf16" | "fp8_block" | "a8w4" | "a4w4" (``expert_quant_scheme`` then applies AITER_FORCE_A8W4).

    Quark MXFP4: quant_method "quark", weights fp4 in groups of 32 with e8m0 scales; the input
    tensors' dtype picks the A operand (fp4 -> a4w4, fp8 -> a8w4). DeepSeek block FP8:
    quant_method "fp8" with weight_block_size [128, 128] (absent: per-tensor scales, refused; other sizes refused). DeepSeek V4 keeps that config but stores the routed
    experts as MXFP4 unless ``expert_dtype`` says fp8 (vLLM's DeepseekV4FP8Config defaults a V4
    model to "fp4" too); fp4 experts declare no activation format: a4w4.
    Anything else is refused by name, never guessed.
    """
    if not quant_cfg:
        return "bf16"
    method = str(quant_cfg.get("quant_method", "")).lower()
    if method == "fp8":
        if str(quant_cfg.get("routed_experts_quant_method", "")).lower() == "mxfp4":
            expert_dtype = expert_dtype or "fp4"  # SGLang's mixed layout: MXFP4 routed experts in an fp8 checkpoint
        experts = str(expert_dtype or ("fp4" if model_type == "deepseek_v4" else "fp8")).lower()
        if experts not in ("fp4", "fp8"):
            raise ConfigError(f"expert_dtype={expert_dtype!r} with quant_method fp8: expected fp4 (DeepSeek V4) or fp8")
        if experts == "fp4":
            return "a4w4"
        try:  # 128 x 128 blocks, fp32 scale_inv: anything else (per-tensor scales, other blocks) refused by name
            check_weight_block_size(quant_cfg.get("weight_block_size"), "quantization_config")
        except BlockFP8Error as exc:
            raise ConfigError(str(exc)) from None
        return "fp8_block"
    if method == "mxfp4":
        return "a4w4"
    if method == "quark":
        layer_cfg = quant_cfg.get("global_quant_config") or {}
        weight = layer_cfg.get("weight") or {}
        inputs = layer_cfg.get("input_tensors") or {}
        wdtype = str(weight.get("dtype", "")).lower()
        if "fp4" not in wdtype:
            raise ConfigError(f"Quark config with weight dtype {wdtype!r}: only fp4 (MXFP4) weights are supported")
        group = weight.get("group_size")
        if group not in (None, 32):
            raise ConfigError(f"Quark MXFP4 weight group_size={group}; MegaMoE needs 32")
        scale = str(weight.get("scale_format", "e8m0")).lower()
        if scale != "e8m0":
            raise ConfigError(f"Quark MXFP4 weight scale_format={scale!r}; MegaMoE needs e8m0")
        idtype = str(inputs.get("dtype", "")).lower() if inputs else ""
        if "fp4" in idtype:
            return "a4w4"
        if "fp8" in idtype:
            return "a8w4"
        raise ConfigError(f"Quark MXFP4 input_tensors dtype {idtype!r}: expected fp4 (A4W4) or fp8 (A8W4)")
    raise ConfigError(f"quantization_config quant_method={method!r} is not supported: MegaMoE serves bf16 experts (no "
                      "quantization_config), MXFP4 experts (quant_method mxfp4, Quark MXFP4, or DeepSeek V4's fp8 "
                      "config with fp4 experts) and block-FP8 experts (quant_method fp8, weight_block_size [128, 128])")
