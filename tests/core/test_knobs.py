"""Knobs.from_env: defaults, every valid value, and a clear error for every bad one."""

from __future__ import annotations

import pytest

from megamoe_backend.knobs import KnobError, Knobs


def test_defaults() -> None:
    k = Knobs.from_env({})
    assert (k.dispatch_wire, k.combine_wire, k.transport, k.max_tokens_per_rank, k.aiter_force_a8w4) == (
        "bf16", "bf16", "auto", 8192, None
    )


def test_all_values() -> None:
    k = Knobs.from_env({
        "MEGA_DISPATCH_WIRE": "FP4", "MEGA_COMBINE_WIRE": "fp8_blockwise_1x32", "MEGA_DISPATCH": "nccl",
        "MEGA_MAX_TOKENS_PER_RANK": "1024", "AITER_FORCE_A8W4": "1", "MEGA_WIRE": "fp4", "MEGA_P2P_TIMEOUT_S": "2.5",
        "MEGA_ON_PEER_TIMEOUT": "Raise",
    })
    assert (k.dispatch_wire, k.combine_wire, k.transport, k.max_tokens_per_rank, k.aiter_force_a8w4, k.p2p_timeout_s,
            k.on_peer_timeout) == ("fp4", "fp8_blockwise_1x32", "nccl", 1024, True, 2.5, "raise")
    assert Knobs.from_env({"MEGA_DISPATCH": "IPC"}).transport == "ipc"
    assert Knobs.from_env({}).p2p_timeout_s == 30.0
    assert Knobs.from_env({}).on_peer_timeout == "exit"  # a dead peer ends the process, as torch's NCCL watchdog does


@pytest.mark.parametrize(
    "env, knob",
    [
        ({"MEGA_DISPATCH_WIRE": "int8"}, "MEGA_DISPATCH_WIRE"),
        ({"MEGA_COMBINE_WIRE": "fp8"}, "MEGA_COMBINE_WIRE"),
        ({"MEGA_DISPATCH": "deepep"}, "MEGA_DISPATCH"),
        ({"MEGA_MAX_TOKENS_PER_RANK": "lots"}, "MEGA_MAX_TOKENS_PER_RANK"),
        ({"MEGA_MAX_TOKENS_PER_RANK": "0"}, "MEGA_MAX_TOKENS_PER_RANK"),
        ({"AITER_FORCE_A8W4": "maybe"}, "AITER_FORCE_A8W4"),
        ({"MEGA_WIRE": "fp4", "MEGA_DISPATCH_WIRE": "fp8"}, "MEGA_WIRE"),
        ({"MEGA_WIRE": "fp4"}, "MEGA_WIRE"),
        ({"MEGA_P2P_TIMEOUT_S": "soon"}, "MEGA_P2P_TIMEOUT_S"),
        ({"MEGA_P2P_TIMEOUT_S": "0"}, "MEGA_P2P_TIMEOUT_S"),
        ({"MEGA_P2P_TIMEOUT_S": "inf"}, "MEGA_P2P_TIMEOUT_S"),
        ({"MEGA_ON_PEER_TIMEOUT": "ignore"}, "MEGA_ON_PEER_TIMEOUT"),
    ],
)
def test_bad_values_name_the_knob(env, knob) -> None:
    with pytest.raises(KnobError, match=knob):
        Knobs.from_env(env)


def test_error_lists_allowed_values() -> None:
    with pytest.raises(KnobError, match=r"bf16 \| fp8 \| fp4"):
        Knobs.from_env({"MEGA_DISPATCH_WIRE": "fp16"})


def test_old_name_equal_is_accepted() -> None:
    assert Knobs.from_env({"MEGA_WIRE": "fp8", "MEGA_DISPATCH_WIRE": "fp8"}).dispatch_wire == "fp8"
    assert Knobs.from_env({"MEGA_WIRE": "bf16"}).dispatch_wire == "bf16"


def test_reads_os_environ(monkeypatch) -> None:
    monkeypatch.setenv("MEGA_DISPATCH_WIRE", "fp8")
    assert Knobs.from_env().dispatch_wire == "fp8"
