"""build_plan: wire/A-operand agreement, block divisibility, placement, bytes, startup line."""

from __future__ import annotations

import dataclasses

import pytest

from megamoe_backend.knobs import KnobError, Knobs
from megamoe_backend.plan import (ExpertPlacement, PlacementError, build_plan, facts_for, initial_redundant_map,
                                  select_for_device)
from megamoe_backend.platform import PackageInfo
from megamoe_backend.experts import ExpertMath
from megamoe_backend.spec import preset


def test_wire_bytes_at_hidden_7168() -> None:
    spec = preset("dsv4-pro")
    for wire, payload, scales in (("bf16", 14336, 0), ("fp4", 3584, 224)):
        wb = build_plan(spec, Knobs(dispatch_wire=wire), 0, 8).wire_bytes()
        assert (wb.dispatch_payload, wb.dispatch_scales) == (payload, scales)
    wb = build_plan(spec, Knobs(dispatch_wire="fp8"), 0, 8, quant="a8w4").wire_bytes()
    assert (wb.dispatch_payload, wb.dispatch_scales, wb.dispatch_meta) == (7168, 224, 6 * 8)
    wb = build_plan(spec, Knobs(combine_wire="fp8_blockwise_1x32"), 0, 8).wire_bytes()
    assert (wb.combine_payload, wb.combine_scales) == (7168, 224)


@pytest.mark.parametrize("quant, wire", [("a4w4", "fp8"), ("a8w4", "fp4"), ("bf16", "fp8"), ("bf16", "fp4"), ("fp8_block", "fp4")])
def test_quantised_wire_must_match_a_operand(quant, wire) -> None:
    with pytest.raises(KnobError, match="MEGA_DISPATCH_WIRE"):
        build_plan(preset("dsv4-pro"), Knobs(dispatch_wire=wire), quant=quant)


@pytest.mark.parametrize("quant", ["bf16", "a8w4", "a4w4", "fp8_block"])
def test_bf16_wire_always_legal(quant) -> None:
    assert build_plan(preset("dsv4-pro"), Knobs(), quant=quant).dispatch.name == "bf16"


def test_hidden_not_multiple_of_32_with_quantised_wire() -> None:
    spec = preset("dsv4-pro").scaled(hidden_size=7170)
    with pytest.raises(ValueError, match="hidden % 32"):
        build_plan(spec, Knobs(dispatch_wire="fp4"))
    with pytest.raises(ValueError, match="MEGA_COMBINE_WIRE"):
        build_plan(spec, Knobs(combine_wire="fp8_blockwise_1x32"), quant="bf16")
    build_plan(spec, Knobs(), quant="bf16")  # bf16 wires do not care


def test_experts_not_divisible_by_ep_size() -> None:
    with pytest.raises(PlacementError, match="not divisible by the EP size 5"):
        build_plan(preset("dsv4-pro"), Knobs(), 0, 5)


def test_placement_with_replicas() -> None:
    # 4 logical experts, 6 physical on 2 ranks; logical 0 and 3 are replicated
    p = ExpertPlacement.from_assignment([0, 0, 0, 1, 1, 1], 2, [0, 1, 3, 0, 2, 3])
    assert p.local_experts(0) == [0, 1, 2] and p.local_experts(1) == [3, 4, 5]
    assert p.num_logical == 4 and p.num_physical == 6
    with pytest.raises(PlacementError, match="no physical replica"):
        ExpertPlacement.from_assignment([0, 1], 2, [0, 2])
    with pytest.raises(PlacementError, match="ranks in 0..1"):
        ExpertPlacement.from_assignment([0, 2], 2)


def test_eplb_contiguous_placement_from_the_engines_initial_map() -> None:
    # 6 logical + 2 redundant over 4 ranks: replicas of logical 0 and 1 on rank 3
    p2l = initial_redundant_map(6, 2)
    assert p2l == [0, 1, 2, 3, 4, 5, 0, 1]
    p = ExpertPlacement.contiguous(p2l, 4, num_logical=6, map_name="test map")
    assert p.local_experts(3) == [6, 7] and p.slot[7] == 1
    assert (p.num_physical, p.num_logical, p.num_redundant) == (8, 6, 2)
    assert p.redundant_per_rank() == (0, 0, 0, 2)
    assert p.describe() == "experts=8 logical=6 redundant/rank=0,0,0,2"
    plan = build_plan(preset("dsv4-pro").scaled(n_routed_experts=8), Knobs(), 3, 4, placement=p)
    assert "experts=8 logical=6 redundant/rank=0,0,0,2 " in plan.startup_line()


def test_bad_eplb_maps_are_errors_naming_the_map() -> None:
    with pytest.raises(PlacementError, match="test map has 9 physical experts, which do not split over 4 EP ranks"):
        ExpertPlacement.contiguous(initial_redundant_map(6, 3), 4, map_name="test map")
    # logical 5 has no replica (also when it is the last one: num_logical says there are 6)
    with pytest.raises(PlacementError, match=r"test map: logical experts \[5\] have no physical replica"):
        ExpertPlacement.contiguous([0, 1, 2, 3, 4, 0, 1, 2], 4, num_logical=6, map_name="test map")
    with pytest.raises(PlacementError, match=r"test map holds logical ids \[7\] outside 0..5"):
        ExpertPlacement.contiguous([0, 1, 2, 3, 4, 5, 7, 0], 4, num_logical=6, map_name="test map")


def test_startup_line() -> None:
    plan = build_plan(preset("dsv4-pro"), Knobs(dispatch_wire="fp4", combine_wire="fp8_blockwise_1x32"), 0, 8)
    line = plan.startup_line("nccl")
    assert line == (
        "[megamoe] Created MegaMoE: ep_rank=0 ep_size=8 hidden=7168 inter=3072 experts=384 logical=384 "
        "redundant/rank=0 topk=6 mtpr=8192 "
        "quant=a4w4 experts_provider=torch transport=nccl wire=fp4 combine=fp8_blockwise_1x32 swiglu_limit=10.0"
    )


def test_layout_key_changes_with_wire() -> None:
    spec = preset("dsv4-pro")
    a = build_plan(spec, Knobs(dispatch_wire="bf16"), 0, 8).layout_key()
    b = build_plan(spec, Knobs(dispatch_wire="fp4"), 0, 8).layout_key()
    c = build_plan(spec, Knobs(combine_wire="fp8_blockwise_1x32"), 0, 8).layout_key()
    assert len({a, b, c}) == 3


def test_selection_cpu_and_cuda() -> None:
    math = ExpertMath("a4w4")
    cpu = select_for_device(Knobs(), math, "cpu")
    assert (cpu.provider, cpu.transport) == ("torch", "gloo")
    # a CUDA host with triton (the device P2P forward runs the Triton experts; without them symm is refused)
    cuda = dataclasses.replace(facts_for("cuda"), packages={**facts_for("cuda").packages,
                                                           "triton": PackageInfo("triton", True)})
    assert select_for_device(Knobs(transport="symm"), math, "cuda", facts=cuda).transport == "symm"
    assert select_for_device(Knobs(), math, "cuda", facts=cuda).transport == "pending"  # the EP group decides
    for bad in ("symm", "mori"):
        with pytest.raises(KnobError, match=f"MEGA_DISPATCH={bad}"):
            select_for_device(Knobs(transport=bad), math, "cpu")
    with pytest.raises(KnobError, match="MEGA_DISPATCH=mori"):
        select_for_device(Knobs(transport="mori"), math, "cuda")
