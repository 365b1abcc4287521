"""The expert quant scheme that runs: what the checkpoint declares x the operator's AITER_FORCE_A8W4.

Why one function: `megamoe info` learns what a checkpoint declares from its config.json, the vLLM
and SGLang plugins from the quant-method objects their engines built, but what then runs must be
one answer everywhere. aiter and ATOM read ``AITER_FORCE_A8W4=1`` as the operator's choice of the A
operand for MXFP4 weights, so MXFP4 experts (Quark A4W4 or A8W4, DeepSeek V4 ``expert_dtype: fp4``)
run A8W4 under it -- and ``MEGA_DISPATCH_WIRE=fp8`` is then the matching quantised wire -- on every
platform. Unset or 0 keeps the checkpoint's own scheme (V4 fp4 experts declare no activation
format: A4W4, as upstream MegaMoE runs them). The knob does not touch bf16 experts.

Where the engine's own quant method names the activation format that config.json leaves open
(``engine_reading``: vLLM 0.33+ reads DeepSeek V4 fp4 experts as W4A8, MXFP8 activations),
``choose_scheme`` follows it by default -- that scheme, and its A operand as the dispatch wire when
MEGA_DISPATCH_WIRE is unset -- so MegaMoE computes what the engine's own MoE path computes for the
same checkpoint. The operator's knobs still choose: AITER_FORCE_A8W4=0 (the checkpoint's own scheme)
or a MEGA_DISPATCH_WIRE that carries the checkpoint's own A operand (fp4) override the reading, and
the choice says so (one startup line in each plugin).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import lru_cache

from ..knobs import Knobs
from .engine_reading import EngineReading
from .moe_spec import A_OPERAND, QUANT_SCHEMES

# What the experts' weights are stored as, per scheme that runs (ExpertWeights.fmt).
WEIGHTS_OF_SCHEME = {"bf16": "bf16", "fp8_block": "fp8_block", "a8w4": "mxfp4", "a4w4": "mxfp4"}
MXFP4_SCHEMES = ("a4w4", "a8w4")


class UnsupportedExpertsError(ValueError):
    """The routed experts use a format MegaMoE cannot serve (named in the message)."""


def expert_quant_scheme(declared: str, force_a8w4: bool | None, where: str = "megamoe") -> str:
    """The scheme the experts run: ``declared`` (bf16 | fp8_block | a8w4 | a4w4) under AITER_FORCE_A8W4.

    ``where`` names the caller in errors (a serving flag, or ``megamoe info``). Block-FP8 experts run as
    declared (the knob is about MXFP4 weights); on a GPU the plan refuses them (``platform.select``: no GPU
    experts provider computes them yet), on the CPU the torch experts do.
    """
    if declared not in QUANT_SCHEMES:
        raise UnsupportedExpertsError(f"{where}: expert quant scheme {declared!r}; expected one of {QUANT_SCHEMES}")
    if force_a8w4 and declared in MXFP4_SCHEMES:
        return "a8w4"
    return declared


def describe_scheme(declared: str, running: str) -> str:
    """``a8w4 (checkpoint a4w4, AITER_FORCE_A8W4=1)`` when the knob changed it, else the scheme."""
    return running if running == declared else f"{running} (checkpoint {declared}, AITER_FORCE_A8W4=1)"


@dataclass(frozen=True)
class SchemeChoice:
    """What the experts run, decided once from the checkpoint, the engine's reading and the knobs."""

    declared: str  # the checkpoint's own scheme (config.json / the engine's parameter layout)
    quant: str  # the scheme that runs
    dispatch_wire: str  # the dispatch wire that runs (MEGA_DISPATCH_WIRE, or the reading's A operand when unset)
    reading: EngineReading | None = None  # the engine's reading of the activation format, None: it names none
    overridden_by: str | None = None  # the knob that overrode the reading, e.g. "AITER_FORCE_A8W4=0"

    def describe(self) -> str:
        """``a8w4 (checkpoint a4w4, engine reading: vLLM ...)``; the scheme alone when nothing changed it."""
        if self.reading is None:
            return describe_scheme(self.declared, self.quant)
        if self.overridden_by is None:
            return f"{self.quant} (checkpoint {self.declared}, engine reading: {self.reading.source})"
        return (f"{self.quant} (checkpoint {self.declared}; engine reading {self.reading.scheme} "
                f"overridden by {self.overridden_by})")

    def override_line(self) -> str | None:
        """The startup line when a knob overrode the engine's reading, else None."""
        if self.reading is None or self.overridden_by is None:
            return None
        return (f"[megamoe] the engine's reading of the checkpoint ({self.reading.source}: {self.reading.scheme}) "
                f"is overridden by {self.overridden_by}: experts run {self.quant}, dispatch wire {self.dispatch_wire}")

    def knobs_for_layer(self, knobs: Knobs) -> Knobs:
        """``knobs`` with the dispatch wire this choice runs (the plan is built from these)."""
        if knobs.dispatch_wire == self.dispatch_wire and knobs.dispatch_wire_set:
            return knobs
        return replace(knobs, dispatch_wire=self.dispatch_wire, dispatch_wire_set=True)


def choose_scheme(declared: str, reading: EngineReading | None, knobs: Knobs, where: str = "megamoe") -> SchemeChoice:
    """The scheme and dispatch wire MegaMoE runs for experts the checkpoint declares as ``declared``.

    Without an engine reading (or for non-MXFP4 experts): ``expert_quant_scheme`` under AITER_FORCE_A8W4,
    on MEGA_DISPATCH_WIRE as set. With one: AITER_FORCE_A8W4=1 / 0 choose as always (A8W4 / the
    checkpoint's own scheme); unset, a MEGA_DISPATCH_WIRE that is the checkpoint's own A operand and not
    the reading's (fp4 for a V4 A8W4 reading) chooses the checkpoint's scheme; otherwise the reading runs,
    on its A operand as the wire when MEGA_DISPATCH_WIRE is unset. A wire that then contradicts the
    scheme is refused later by the plan (``check_wire_matches_quant``), naming the knob.
    """
    if reading is None or declared not in MXFP4_SCHEMES:
        return SchemeChoice(declared, expert_quant_scheme(declared, knobs.aiter_force_a8w4, where), knobs.dispatch_wire)
    if reading.scheme not in MXFP4_SCHEMES:
        raise UnsupportedExpertsError(f"{where}: {reading.source} reads the experts as {reading.scheme!r}; "
                                      f"MegaMoE runs MXFP4 weights as one of {MXFP4_SCHEMES}")
    force, wire = knobs.aiter_force_a8w4, knobs.dispatch_wire
    if force is not None:
        quant, knob = expert_quant_scheme(declared, force, where), f"AITER_FORCE_A8W4={int(force)}"
    elif knobs.dispatch_wire_set and wire == A_OPERAND[declared] and wire != A_OPERAND[reading.scheme]:
        quant, knob = declared, f"MEGA_DISPATCH_WIRE={wire}"
    else:
        quant, knob = reading.scheme, None
    if quant == reading.scheme:
        wire = wire if knobs.dispatch_wire_set else A_OPERAND[quant]
        return SchemeChoice(declared, quant, wire, reading)
    return SchemeChoice(declared, quant, wire, reading, knob)


@lru_cache(maxsize=None)
def _warn_once(line: str) -> None:
    """Cache of lines already logged in this process: every MoE layer makes the same choice, one line says it."""
    logging.getLogger("megamoe").warning(line)


def log_override(choice: SchemeChoice) -> None:
    """The startup line (logger "megamoe", once per process) when a knob overrode the engine's reading."""
    line = choice.override_line()
    if line is not None:
        _warn_once(line)


__all__ = ["MXFP4_SCHEMES", "WEIGHTS_OF_SCHEME", "SchemeChoice", "UnsupportedExpertsError", "choose_scheme",
           "describe_scheme", "expert_quant_scheme", "log_override"]
