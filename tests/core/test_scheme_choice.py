"""spec.choose_scheme: the engine's reading of the checkpoint x the knobs -> the scheme and dispatch wire that run.

The decision both plugins and `megamoe info` call (tests/fixtures/quant_scheme_table.json holds all three to it
per engine release). Here: the rule's edges the table does not spell out, and the knob layer's "unset" vs "bf16".

Planted mutation (run once, then restored): in ``choose_scheme`` the default wire ``A_OPERAND[quant]`` replaced
by ``knobs.dispatch_wire`` (a followed reading keeps the bf16 default wire): 3 failed, 12 passed.
"""

from __future__ import annotations

import logging

import pytest

from megamoe_backend.knobs import KnobError, Knobs
from megamoe_backend.spec import EngineReading, EngineRelease, UnsupportedExpertsError, choose_scheme, log_override
from megamoe_backend.spec import expert_scheme

MXFP8 = EngineReading("a8w4", "vLLM 0.33 Mxfp4MoEMethod(activation_key=kMxfp8Dynamic)")


def test_knobs_tell_unset_from_bf16_and_keep_the_old_name_rule() -> None:
    assert Knobs.from_env({}).dispatch_wire_set is False
    assert Knobs.from_env({"MEGA_DISPATCH_WIRE": " "}).dispatch_wire_set is False  # empty reads as unset, as before
    assert Knobs.from_env({"MEGA_DISPATCH_WIRE": "bf16"}).dispatch_wire_set is True
    assert Knobs.from_env({"MEGA_WIRE": "bf16"}).dispatch_wire_set is True  # the old name sets it too
    assert Knobs().dispatch_wire_set is True  # knobs built in code chose their wire
    with pytest.raises(KnobError, match="MEGA_WIRE='fp8' is the old name"):
        Knobs.from_env({"MEGA_WIRE": "fp8"})  # unchanged: the old name must agree with the resolved wire


@pytest.mark.parametrize("env, expect", [
    ({}, ("a8w4", "fp8", None)),
    ({"AITER_FORCE_A8W4": "1"}, ("a8w4", "fp8", None)),
    ({"AITER_FORCE_A8W4": "0"}, ("a4w4", "bf16", "AITER_FORCE_A8W4=0")),
    ({"MEGA_DISPATCH_WIRE": "fp4"}, ("a4w4", "fp4", "MEGA_DISPATCH_WIRE=fp4")),
    ({"MEGA_DISPATCH_WIRE": "bf16"}, ("a8w4", "bf16", None)),
    ({"MEGA_WIRE": "bf16"}, ("a8w4", "bf16", None)),
    ({"AITER_FORCE_A8W4": "0", "MEGA_DISPATCH_WIRE": "fp4"}, ("a4w4", "fp4", "AITER_FORCE_A8W4=0")),
])
def test_an_mxfp8_reading_of_a4w4_weights(env, expect) -> None:
    c = choose_scheme("a4w4", MXFP8, Knobs.from_env(env))
    assert (c.quant, c.dispatch_wire, c.overridden_by) == expect


def test_the_layer_knobs_carry_the_chosen_wire_and_rechoose_the_same() -> None:
    knobs = Knobs.from_env({})
    c = choose_scheme("a4w4", MXFP8, knobs)
    layer = c.knobs_for_layer(knobs)
    assert (layer.dispatch_wire, layer.dispatch_wire_set, knobs.dispatch_wire) == ("fp8", True, "bf16")
    again = choose_scheme("a4w4", MXFP8, layer)  # MegaMoEMethod re-derives its format from the layer's knobs
    assert (again.quant, again.dispatch_wire, again.overridden_by) == (c.quant, c.dispatch_wire, None)


def test_no_reading_and_non_mxfp4_experts_are_unchanged() -> None:
    assert choose_scheme("a4w4", None, Knobs.from_env({})).dispatch_wire == "bf16"
    assert choose_scheme("bf16", MXFP8, Knobs.from_env({})).quant == "bf16"  # a reading never touches bf16 experts
    block = choose_scheme("fp8_block", MXFP8, Knobs.from_env({}), "--moe-backend megamoe_ep")  # nor block-FP8 ones
    assert (block.quant, block.dispatch_wire, block.overridden_by) == ("fp8_block", "bf16", None)
    with pytest.raises(UnsupportedExpertsError, match="reads the experts as 'bf16'"):
        choose_scheme("a4w4", EngineReading("bf16", "odd"), Knobs.from_env({}))


def test_override_line_is_logged_once_per_process(caplog) -> None:
    expert_scheme._warn_once.cache_clear()
    c = choose_scheme("a4w4", MXFP8, Knobs.from_env({"AITER_FORCE_A8W4": "0"}))
    with caplog.at_level(logging.WARNING, logger="megamoe"):
        for _ in range(3):  # three MoE layers
            log_override(c)
        log_override(choose_scheme("a4w4", MXFP8, Knobs.from_env({})))  # followed: nothing to say
    lines = [r.getMessage() for r in caplog.records if r.name == "megamoe"]
    assert lines == ["[megamoe] the engine's reading of the checkpoint (vLLM 0.33 Mxfp4MoEMethod(activation_key="
                     "kMxfp8Dynamic): a8w4) is overridden by AITER_FORCE_A8W4=0: experts run a4w4, dispatch wire bf16"]


@pytest.mark.parametrize("text, engine, version", [
    ("vllm-0.33", "vllm", (0, 33)), ("vllm==0.34.0", "vllm", (0, 34, 0)), ("vLLM 0.32.1+cpu", "vllm", (0, 32, 1)),
    ("sglang-0.5.23", "sglang", (0, 5, 23)),
])
def test_engine_release_names(text, engine, version) -> None:
    assert EngineRelease.parse(text) == EngineRelease(engine, version)
