"""MEGA_* environment knobs, read once and validated.

Why strict: a silently ignored or mistyped variable serves the wrong wire while the operator
believes otherwise. Every value is checked against its allowed set and an error names the variable.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Mapping

DISPATCH_WIRE_VALUES = ("bf16", "fp8", "fp4")
COMBINE_WIRE_VALUES = ("bf16", "fp8_blockwise_1x32")
# flydsl: aiter MegaMoEGfx1250's own dispatch kernel (gfx1250 only; see docs/rocm.md)
# symm / ipc: the device P2P forward (layer/device/ep.py) over torch symmetric memory (GPUs of one
# NVLink domain) or CUDA IPC (rank processes of one host, several may share a GPU)
TRANSPORT_VALUES = ("auto", "nccl", "symm", "ipc", "mori", "flydsl")
# what a peer timeout of the device P2P forward does (layer/device/watchdog.py): end the process
# (exit, as torch's NCCL watchdog does with async error handling) or raise at the next eager forward
ON_PEER_TIMEOUT_VALUES = ("exit", "raise")
# who runs the A8W4 expert GEMMs: the project's Triton kernels (experts/triton/), humming-kernels (experts/humming/,
# what vLLM runs on Hopper), or auto: one rule decides (experts/gemm_choice.py: humming on sm_90 where it is installed)
EXPERTS_GEMM_VALUES = ("auto", "triton", "humming")
# MEGA_EXPERTS_GEMM=cuda chose the sm_90a CUDA GEMMs until they were measured slower than Triton in every
# bucket (docs/triton.md): they left the package, and the value is refused saying where they went
CUDA_GEMMS_MOVED = (
    "MEGA_EXPERTS_GEMM=cuda: the sm_90a CUDA expert GEMMs are no longer part of megamoe_backend (measured slower "
    "than the Triton GEMMs in every bucket, docs/triton.md); the research code lives in the repository's "
    "benchmarks/research/cuda_gemms/. Unset MEGA_EXPERTS_GEMM or set it to auto | triton | humming"
)
DEFAULT_MAX_TOKENS_PER_RANK = 8192
DEFAULT_P2P_TIMEOUT_S = 30.0
# The start-up forwards' bound (layer/device/startup_wait.py says which forwards): they include every
# rank's first Triton compiles, which a 2-core-per-rank host can stretch past a minute on one rank.
DEFAULT_P2P_STARTUP_TIMEOUT_S = 600.0

KNOB_NAMES = (
    "MEGA_DISPATCH_WIRE",
    "MEGA_WIRE",
    "MEGA_COMBINE_WIRE",
    "MEGA_DISPATCH",
    "MEGA_MAX_TOKENS_PER_RANK",
    "MEGA_P2P_TIMEOUT_S",
    "MEGA_P2P_STARTUP_TIMEOUT_S",
    "MEGA_ON_PEER_TIMEOUT",
    "MEGA_EXPERTS_GEMM",
    "AITER_FORCE_A8W4",
)


class KnobError(ValueError):
    """A MEGA_* / AITER_* environment variable holds a value MegaMoE cannot serve."""


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...], default: str) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in allowed:
        raise KnobError(f"{name}={raw!r} is not valid; allowed values: {' | '.join(allowed)}")
    return value


def _positive(env: Mapping[str, str], name: str, default, parse, what: str):
    """A number > 0 (finite) from ``env[name]`` parsed by ``parse`` (int / float), else ``default``."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = parse(raw.strip())
    except ValueError:
        raise KnobError(f"{name}={raw!r} is not {'an integer' if parse is int else 'a number'}; expected {what}") from None
    if not value > 0 or value == float("inf"):
        raise KnobError(f"{name}={raw!r} must be {what}")
    return value


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    return _positive(env, name, default, int, "a positive token count")


def _positive_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    return _positive(env, name, default, float, "a finite number of seconds > 0")


def _optional_bool(env: Mapping[str, str], name: str) -> bool | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise KnobError(f"{name}={raw!r} is not valid; allowed values: 1 | 0 (or true | false)")


def check_experts_gemm(value: str) -> str:
    """``value`` if MEGA_EXPERTS_GEMM may hold it, else a KnobError (Knobs and TritonExperts(gemm=) ask here)."""
    if value == "cuda":
        raise KnobError(CUDA_GEMMS_MOVED)
    if value not in EXPERTS_GEMM_VALUES:
        raise KnobError(f"MEGA_EXPERTS_GEMM={value!r} is not valid; allowed values: {' | '.join(EXPERTS_GEMM_VALUES)}")
    return value


def experts_gemm_from_env(env: Mapping[str, str] | None = None) -> str:
    """MEGA_EXPERTS_GEMM, validated (Knobs.from_env's reading; the providers get it from the Knobs)."""
    env = os.environ if env is None else env
    if (env.get("MEGA_EXPERTS_GEMM") or "").strip().lower() == "cuda":
        raise KnobError(CUDA_GEMMS_MOVED)
    return _choice(env, "MEGA_EXPERTS_GEMM", EXPERTS_GEMM_VALUES, "auto")


@dataclass(frozen=True)
class Knobs:
    """The operator's choices. Defaults: bf16 wires, automatic transport, 8192 tokens per rank.

    ``dispatch_wire_set`` is False only when ``from_env`` found neither MEGA_DISPATCH_WIRE nor its old
    name MEGA_WIRE: the bf16 wire is then a default that the engine's reading of the checkpoint may
    replace (``spec.choose_scheme``: vLLM 0.33+ DeepSeek V4 -> A8W4 on the fp8 wire). Knobs built in
    code chose their wire.
    """

    dispatch_wire: str = "bf16"
    combine_wire: str = "bf16"
    transport: str = "auto"
    max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK
    aiter_force_a8w4: bool | None = None
    p2p_timeout_s: float = DEFAULT_P2P_TIMEOUT_S  # the device P2P forward's bound on every wait for a peer
    p2p_startup_timeout_s: float = DEFAULT_P2P_STARTUP_TIMEOUT_S  # ... in the start-up forwards (JIT compiles)
    on_peer_timeout: str = "exit"  # a peer that timed out: "exit" ends this process, "raise" raises at the next eager call
    experts_gemm: str = "auto"  # expert GEMMs: "auto" | "triton" | "humming" (experts/gemm_choice.py decides)
    dispatch_wire_set: bool = True  # False: MEGA_DISPATCH_WIRE / MEGA_WIRE unset, dispatch_wire is the default

    def __post_init__(self) -> None:
        check_experts_gemm(self.experts_gemm)
        for field, allowed, knob in (
            ("dispatch_wire", DISPATCH_WIRE_VALUES, "MEGA_DISPATCH_WIRE"),
            ("combine_wire", COMBINE_WIRE_VALUES, "MEGA_COMBINE_WIRE"),
            ("transport", TRANSPORT_VALUES, "MEGA_DISPATCH"),
            ("on_peer_timeout", ON_PEER_TIMEOUT_VALUES, "MEGA_ON_PEER_TIMEOUT"),
        ):
            if getattr(self, field) not in allowed:
                raise KnobError(f"{knob}={getattr(self, field)!r} is not valid; allowed values: {' | '.join(allowed)}")
        if self.max_tokens_per_rank <= 0:
            raise KnobError(f"MEGA_MAX_TOKENS_PER_RANK={self.max_tokens_per_rank} must be a positive token count")
        if not self.p2p_timeout_s > 0 or self.p2p_timeout_s == float("inf"):
            raise KnobError(f"MEGA_P2P_TIMEOUT_S={self.p2p_timeout_s} must be a finite number of seconds > 0")
        if not self.p2p_startup_timeout_s > 0 or self.p2p_startup_timeout_s == float("inf"):
            raise KnobError(f"MEGA_P2P_STARTUP_TIMEOUT_S={self.p2p_startup_timeout_s} must be a finite number of "
                            "seconds > 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Knobs":
        env = os.environ if env is None else env
        wire = _choice(env, "MEGA_DISPATCH_WIRE", DISPATCH_WIRE_VALUES, "bf16")
        old = env.get("MEGA_WIRE")
        if old is not None and old.strip() != "" and old.strip().lower() != wire:
            raise KnobError(
                f"MEGA_WIRE={old!r} is the old name of MEGA_DISPATCH_WIRE and disagrees with it "
                f"(MEGA_DISPATCH_WIRE resolves to {wire!r}); set MEGA_DISPATCH_WIRE={old.strip().lower()} "
                "and remove MEGA_WIRE, or make them equal"
            )
        wire_set = any((env.get(name) or "").strip() != "" for name in ("MEGA_DISPATCH_WIRE", "MEGA_WIRE"))
        return cls(
            dispatch_wire=wire,
            dispatch_wire_set=wire_set,
            combine_wire=_choice(env, "MEGA_COMBINE_WIRE", COMBINE_WIRE_VALUES, "bf16"),
            transport=_choice(env, "MEGA_DISPATCH", TRANSPORT_VALUES, "auto"),
            max_tokens_per_rank=_positive_int(env, "MEGA_MAX_TOKENS_PER_RANK", DEFAULT_MAX_TOKENS_PER_RANK),
            aiter_force_a8w4=_optional_bool(env, "AITER_FORCE_A8W4"),
            p2p_timeout_s=_positive_seconds(env, "MEGA_P2P_TIMEOUT_S", DEFAULT_P2P_TIMEOUT_S),
            p2p_startup_timeout_s=_positive_seconds(env, "MEGA_P2P_STARTUP_TIMEOUT_S", DEFAULT_P2P_STARTUP_TIMEOUT_S),
            on_peer_timeout=_choice(env, "MEGA_ON_PEER_TIMEOUT", ON_PEER_TIMEOUT_VALUES, "exit"),
            experts_gemm=experts_gemm_from_env(env),
        )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
