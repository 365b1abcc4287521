"""Which forwards wait with the start-up bound (megamoe_backend/layer/device/startup_wait.py).

The rule the P2P forward asks before each forward; the forward's use of the answer is checked by
tests/kernels/test_p2p_interpreter.py (a rank late by 4x MEGA_P2P_TIMEOUT_S in its first forward
ends nobody; the same lateness later is a timeout)."""

from __future__ import annotations

import pytest

from megamoe_backend.knobs import KnobError, Knobs
from megamoe_backend.layer.device.startup_wait import WaitFacts, takes_startup_bound


@pytest.mark.parametrize("facts,startup", [
    (WaitFacts(capturing=False, forwards_done=0, engine_captures=False, captured_before=False), True),  # first forward
    (WaitFacts(capturing=False, forwards_done=5, engine_captures=False, captured_before=False), False),  # eager engine, later
    (WaitFacts(capturing=False, forwards_done=5, engine_captures=True, captured_before=False), True),  # warm-up before capture
    (WaitFacts(capturing=True, forwards_done=0, engine_captures=True, captured_before=False), False),  # baked into a graph
    (WaitFacts(capturing=False, forwards_done=9, engine_captures=True, captured_before=True), False),  # serving after capture
])
def test_startup_bound_applies_to_start_up_forwards_only(facts, startup):
    assert takes_startup_bound(facts) is startup


def test_startup_timeout_knob():
    assert Knobs.from_env({}).p2p_startup_timeout_s == 600.0
    assert Knobs.from_env({"MEGA_P2P_STARTUP_TIMEOUT_S": "90"}).p2p_startup_timeout_s == 90.0
    for bad in ("0", "inf", "soon"):
        with pytest.raises(KnobError, match="MEGA_P2P_STARTUP_TIMEOUT_S"):
            Knobs.from_env({"MEGA_P2P_STARTUP_TIMEOUT_S": bad})
