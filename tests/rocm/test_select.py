"""Backend selection: CUDA -> triton + nccl/symm, ROCm with aiter + mori -> aiter over mori, CPU -> torch;
and every bad knob combination on the AMD path is an error that names the knob."""

from __future__ import annotations

import pytest
from rocm_helpers import (
    GFX1250_CAPS_NEW,
    GFX1250_CAPS_OLD,
    GFX1250_INIT_NEW,
    R1,
    V2_CAPS,
    cpu_facts,
    cuda_facts,
    knobs,
    loose_knobs,
    rocm_ask,
    rocm_facts,
    use_a4w4_plan_builder,
    use_scale_row_mori,
)

from megamoe_backend.experts.base import ExpertMath
from megamoe_backend.knobs import KnobError
from megamoe_backend.platform import PlatformError, RocmAsk, RocmProbes, select_backends
from megamoe_backend.platform.facts import AiterCaps

A8W4 = ExpertMath("a8w4")
A4W4 = ExpertMath("a4w4")
BF16 = ExpertMath("bf16")
SCALE_ROW = RocmProbes(mori_scale_row=lambda: True)  # a mori with ROCm/mori#593


# ---- the three platforms --------------------------------------------------------------------

@pytest.mark.parametrize("transport", ["symm", "ipc"])
def test_the_p2p_transports_on_cpu_are_an_error(transport):
    with pytest.raises(PlatformError, match=f"MEGA_DISPATCH={transport} is the device P2P path and needs CUDA"):
        select_backends(cpu_facts(triton=True), knobs(transport=transport), A8W4)


def test_cpu_selects_torch_over_gloo():
    sel = select_backends(cpu_facts(triton=True), knobs(), A8W4)
    assert (sel.provider, sel.transport, sel.fused) == ("torch", "gloo", False)


def test_cuda_selects_triton_and_nccl_or_symm():
    assert (select_backends(cuda_facts(), knobs(), A8W4).provider, select_backends(cuda_facts(), knobs(), A8W4).transport) == ("triton", "pending")
    assert select_backends(cuda_facts(), knobs(transport="symm"), A8W4).transport == "symm"
    assert select_backends(cuda_facts(), knobs(transport="ipc"), A8W4).transport == "ipc"
    assert select_backends(cuda_facts(triton=False), knobs(), A8W4).provider == "torch"


def v2(knobs_, ep_size=8, num_experts=384, math=A8W4, facts=None, **ask):
    """gfx950 selection with the model shape, asking the (fake) installed aiter's plan builder."""
    return select_backends(facts or rocm_facts("gfx950"), knobs_, math, ep_size=ep_size, num_experts=num_experts,
                           rocm=rocm_ask(**ask))


def test_gfx950_with_packages_selects_aiter_megamoe_v2_over_mori(fakes):
    sel = v2(knobs(dispatch_wire="fp8", combine_wire="fp8_blockwise_1x32"))
    assert (sel.provider, sel.transport, sel.runtime, sel.dispatch_kernel) == ("aiter", "mori", "MegaMoEV2", "flydsl")
    assert sel.mtpr == 8192 and sel.a_operand == "fp8"
    assert "provider=aiter:MegaMoEV2 transport=mori" in sel.describe() and "wire=fp8" in sel.describe()


def test_gfx1250_with_packages_selects_aiter_megamoe_gfx1250_over_mori(fakes, monkeypatch):
    use_scale_row_mori(fakes, monkeypatch)
    sel = select_backends(rocm_facts("gfx1250", force_a8w4="1"), knobs(dispatch_wire="fp8", aiter_force_a8w4=True), A8W4, ep_size=8, num_experts=256)
    assert (sel.provider, sel.transport, sel.runtime, sel.dispatch_kernel) == ("aiter", "mori", "MegaMoEGfx1250", "mori")
    assert sel.a_operand == "fp8" and sel.combine_quant == "none"
    assert "dispatch=mori" in sel.describe() and "wire=fp8" in sel.describe()
    assert any("ATOM's default" in r for r in sel.reasons)


def test_gfx1250_bf16_wire_keeps_aiters_default_flydsl_dispatch_unless_mori_asked():
    sel = select_backends(rocm_facts("gfx1250", force_a8w4="1"), knobs(aiter_force_a8w4=True), A8W4)
    assert (sel.runtime, sel.dispatch_kernel) == ("MegaMoEGfx1250", "flydsl")
    sel = select_backends(rocm_facts("gfx1250", force_a8w4="1"), knobs(transport="mori", aiter_force_a8w4=True), A8W4)
    assert sel.dispatch_kernel == "mori"


def gfx1250_a8w4(caps=None):
    """gfx1250 with AITER_FORCE_A8W4=1, the only setting its fused runtime runs (A8W4)."""
    return rocm_facts("gfx1250", caps=caps, force_a8w4="1")


def test_gfx1250_a4w4_without_force_a8w4_runs_fused(fakes):
    """A4W4 on gfx1250 (fp4 A operand, AITER_FORCE_A8W4 unset) fuses: the weights reach aiter as fp4x2,
    which its grouped kernel takes for A4W4 (grouped_moe_gfx1250.py:991), as ATOM runs ``wire=fp4
    force_a8w4=0``. On the old code (gfx1250_fused_refusal: "set AITER_FORCE_A8W4=1") this test FAILS."""
    for wire in ("fp4", "bf16"):
        sel = select_backends(rocm_facts("gfx1250"), knobs(dispatch_wire=wire), A4W4, rocm=RocmAsk(probes=SCALE_ROW))
        assert (sel.fused, sel.runtime, sel.a_operand) == (True, "MegaMoEGfx1250", "fp4")
        assert any("fp4x2" in r for r in sel.reasons)


def test_gfx1250_combine_wire_maps_to_combine_quant_mxfp8():
    sel = select_backends(gfx1250_a8w4(), knobs(combine_wire="fp8_blockwise_1x32", aiter_force_a8w4=True), A8W4)
    assert sel.fused and sel.combine_quant == "mxfp8"


def test_plan_uses_platform_selection_for_rocm(fakes):
    from megamoe_backend.plan.selection import select_for_device as plan_select

    k = knobs(dispatch_wire="fp8", combine_wire="fp8_blockwise_1x32")
    choice = plan_select(k, A8W4, "rocm", facts=rocm_facts("gfx950"), ep_size=8, num_experts=384, shape=rocm_ask().shape,
                         ep_rank=0)
    assert (choice.provider, choice.transport, choice.runtime) == ("aiter", "mori", "MegaMoEV2")
    assert "dispatch=flydsl" in choice.describe()


def test_v2_without_the_model_shape_is_not_fused():
    sel = select_backends(rocm_facts("gfx950"), knobs(dispatch_wire="fp8"), A8W4, ep_size=8, num_experts=384)
    assert not sel.fused and any("model shape and EP size are needed" in r for r in sel.reasons)


# ---- unfused fallbacks, each with the reason naming the knob ---------------------------------

def test_v2_with_the_default_knobs_is_fused_and_says_what_travels(fakes):
    """Upstream runs MegaMoEV2 by default; MEGA_DISPATCH_WIRE=bf16 (the default) is what the receiver would
    quantise to fp8 for a8w4, which MegaMoEV2 does on the sender."""
    sel = v2(knobs())
    assert (sel.provider, sel.runtime, sel.dispatch_wire) == ("aiter", "MegaMoEV2", "fp8")
    assert any("MEGA_DISPATCH_WIRE=bf16: MegaMoEV2 sends fp8 rows quantised on the sender" in r for r in sel.reasons)
    sel = v2(knobs(dispatch_wire="fp4"))
    assert not sel.fused and any("set MEGA_DISPATCH_WIRE=fp8 or bf16" in r for r in sel.reasons)


def test_v2_combine_wire_follows_aiters_runtimes_and_a_mismatch_is_named(fakes):
    sel = v2(knobs(dispatch_wire="fp8", combine_wire="fp8_blockwise_1x32", max_tokens_per_rank=512))
    assert not sel.fused and any("MEGA_COMBINE_WIRE=fp8_blockwise_1x32 -> set MEGA_COMBINE_WIRE=bf16" in r for r in sel.reasons)
    sel = v2(knobs(dispatch_wire="fp8", max_tokens_per_rank=512))
    assert sel.fused and sel.combine_wire == "bf16"
    sel = v2(knobs(combine_wire="fp8_blockwise_1x32"))  # the knob asks for fp8: every step on the max runtime
    assert [r.describe() for r in sel.runtimes] == ["8192:compact/fp8_blockwise_1x32"]


def test_gfx942_has_no_fused_runtime_and_uses_mori_transport():
    sel = select_backends(rocm_facts("gfx942"), knobs(), A8W4)
    assert (sel.provider, sel.transport) == ("triton", "mori")
    assert any("gfx942" in r for r in sel.reasons)


def test_bf16_model_is_not_fused():
    sel = select_backends(rocm_facts("gfx950"), knobs(), BF16)
    assert not sel.fused and any("MXFP4" in r for r in sel.reasons)


def test_rocm_without_aiter_uses_mori_with_local_experts():
    sel = select_backends(rocm_facts("gfx950", aiter=False, triton=False), knobs(dispatch_wire="fp8"), A8W4)
    assert (sel.provider, sel.transport) == ("torch", "mori")


def test_rocm_without_mori_falls_back_to_rccl():
    sel = select_backends(rocm_facts("gfx950", mori=False), knobs(), A8W4)
    assert (sel.provider, sel.transport) == ("triton", "nccl")


def test_old_gfx1250_without_dispatch_wire_argument_cannot_fuse_a_quantised_wire():
    sel = select_backends(rocm_facts("gfx1250", caps=GFX1250_CAPS_OLD, force_a8w4="1"), knobs(dispatch_wire="fp8", aiter_force_a8w4=True), A8W4)
    assert not sel.fused and any("no dispatch_wire argument" in r for r in sel.reasons)
    assert sel.transport == "mori"


def test_old_gfx1250_without_combine_quant_cannot_fuse_fp8_combine():
    k = knobs(combine_wire="fp8_blockwise_1x32", aiter_force_a8w4=True)
    sel = select_backends(gfx1250_a8w4(GFX1250_CAPS_OLD), k, A8W4)
    assert not sel.fused and any("combine_quant" in r for r in sel.reasons)


def test_aiter_without_megamoe_classes_is_not_fused():
    sel = v2(knobs(dispatch_wire="fp8", max_tokens_per_rank=512), facts=rocm_facts("gfx950", caps=AiterCaps()))
    assert not sel.fused and any("no aiter.ops.flydsl.kernels.mega_moe.MegaMoEV2" in r for r in sel.reasons)


def test_v2_a4w4_only_where_installed_aiter_accepts_it(fakes, monkeypatch):
    """A4W4 on MegaMoEV2 needs the A4W4 revision's plan builder, which takes ``a_dtype=`` (4d06fb8d's
    takes none): the facts read it from the builder's signature and selection passes
    ``a_dtype="fp4"``, so the plan (its P2P wire per entry) is the fp4 one. On the old code (no
    ``a_dtype`` passed; A4W4 detected by "a4w4" in MegaMoEV2.__init__'s source) this test FAILS."""
    from megamoe_backend.platform.facts import probe_aiter_caps

    sel = v2(knobs(dispatch_wire="fp4", max_tokens_per_rank=512), math=A4W4)
    assert not sel.fused and any("a8w4' only" in r for r in sel.reasons)
    assert not probe_aiter_caps().v2_accepts_a4w4
    use_a4w4_plan_builder(fakes, monkeypatch)
    caps = probe_aiter_caps()
    assert caps.v2_accepts_a4w4
    fakes.aiter.CALL_LOG.clear()
    sel = v2(knobs(dispatch_wire="fp4", max_tokens_per_rank=1024), math=A4W4, facts=rocm_facts("gfx950", caps=caps))
    assert sel.fused and sel.a_operand == "fp4" and sel.combine_wire == "fp8_blockwise_1x32"
    asked = [c[1] for c in fakes.aiter.CALL_LOG if c[0] == "build_mega_moe_bundle_plan"]
    assert asked and all(c["a_dtype"] == "fp4" for c in asked)


def test_explicit_nccl_on_rocm_skips_the_fused_runtime():
    sel = select_backends(rocm_facts("gfx950"), knobs(transport="nccl", dispatch_wire="fp8", max_tokens_per_rank=512), A8W4)
    assert (sel.transport, sel.fused) == ("nccl", False)


def test_mori_blockwise_combine_with_quantised_dispatch_is_outside_moris_matrix():
    k = knobs(dispatch_wire="fp8", combine_wire="fp8_blockwise_1x32", transport="mori")
    with pytest.raises(KnobError, match="requires bf16 dispatch and combine dtypes"):
        select_backends(rocm_facts("gfx942"), k, A8W4)
    sel = select_backends(rocm_facts("gfx942"), knobs(dispatch_wire="fp8", combine_wire="fp8_blockwise_1x32"), A8W4)
    assert sel.transport == "nccl"


# ---- MTPR ---------------------------------------------------------------------------------

def test_v2_mtpr_rounds_up_to_a_power_of_two_and_says_so(fakes):
    sel = v2(knobs(dispatch_wire="fp8", max_tokens_per_rank=1000), num_experts=256, shape=R1)
    assert sel.fused and sel.mtpr == 1024
    assert any("rounded up to 1024" in r for r in sel.reasons)


def test_gfx1250_mtpr_is_not_rounded():
    sel = select_backends(gfx1250_a8w4(), knobs(max_tokens_per_rank=1000, aiter_force_a8w4=True), A8W4)
    assert sel.fused and sel.mtpr == 1000


# ---- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "facts, missing",
    [
        (rocm_facts("gfx950", mori=False), "amd-mori"),
        (cuda_facts(), "ROCm build of torch"),
        (cpu_facts(), "ROCm build of torch"),
    ],
)
def test_mega_dispatch_mori_without_mori_names_what_is_missing(facts, missing):
    with pytest.raises(PlatformError, match=missing) as err:
        select_backends(facts, knobs(transport="mori"), A8W4)
    assert "MEGA_DISPATCH=mori" in str(err.value)


def test_mega_dispatch_mori_on_rocm_build_without_gpu():
    facts = rocm_facts("gfx950")
    facts = type(facts)(**{**facts.__dict__, "device": "cpu"})
    with pytest.raises(PlatformError, match="visible AMD GPU"):
        select_backends(facts, knobs(transport="mori"), A8W4)


def test_quantised_wire_with_flydsl_dispatch_runs_the_compact_plan(fakes, monkeypatch):
    """22f2e2dc lets the flydsl dispatch carry the scale row with ``stage1_fused=True`` (its compact plan),
    which is how ATOM serves MEGA_DISPATCH=flydsl on a quantised wire; auto takes it where mori has no
    scale row. On the old code (every quantised wire forced onto mori, stage1_fused never passed) this
    test FAILS (dispatch_kernel "mori")."""
    facts = rocm_facts("gfx1250", force_a8w4="1")
    sel = select_backends(facts, loose_knobs(transport="flydsl", dispatch_wire="fp8", aiter_force_a8w4=True), A8W4)
    assert (sel.dispatch_kernel, sel.stage1_fused) == ("flydsl", True) and "stage1_fused=True" in sel.describe()
    sel = select_backends(facts, knobs(dispatch_wire="fp8", aiter_force_a8w4=True), A8W4)  # auto, 624002c8 mori
    assert (sel.fused, sel.dispatch_kernel, sel.stage1_fused) == (True, "flydsl", True)
    use_scale_row_mori(fakes, monkeypatch)
    sel = select_backends(facts, knobs(dispatch_wire="fp8", aiter_force_a8w4=True), A8W4)  # auto, #593 mori
    assert (sel.dispatch_kernel, sel.stage1_fused) == ("mori", False)
    old = rocm_facts("gfx1250", force_a8w4="1", caps=AiterCaps(gfx1250_init=GFX1250_INIT_NEW[:-2] + ("combine_quant",),
                                                                gfx1250_forward=("combine_quant",)))
    sel = select_backends(old, loose_knobs(transport="flydsl", dispatch_wire="fp8", aiter_force_a8w4=True), A8W4)
    assert sel.dispatch_kernel == "mori"  # no stage1_fused: only mori carries the row


def test_gfx1250_topk_above_the_wave_size_is_not_fused():
    """22f2e2dc MegaMoEConfig: "dispatch requires topk in [1, _WAVE_SIZE]" (32). On the old code
    (GFX1250_WAVE_SIZE unused) this test FAILS (selected fused)."""
    from megamoe_backend.platform import MoEShape

    ask = RocmAsk(shape=MoEShape(7168, 2048, 33), probes=SCALE_ROW)
    sel = select_backends(gfx1250_a8w4(), knobs(aiter_force_a8w4=True), A8W4, ep_size=8, num_experts=256, rocm=ask)
    assert not sel.fused and any("top-k in [1, 32]" in r for r in sel.reasons)


def test_flydsl_dispatch_without_mori_fails_clearly():
    with pytest.raises(PlatformError, match="MEGA_DISPATCH=flydsl needs .*amd-mori"):
        select_backends(rocm_facts("gfx1250", mori=False), loose_knobs(transport="flydsl", dispatch_wire="fp4"), A4W4)


def test_flydsl_dispatch_where_no_fused_runtime_can_run_fails():
    with pytest.raises(PlatformError, match="MEGA_DISPATCH=flydsl names aiter's fused dispatch"):
        select_backends(rocm_facts("gfx942"), loose_knobs(transport="flydsl"), A8W4)


def test_aiter_force_a8w4_contradicting_the_wire_is_an_error():
    with pytest.raises(KnobError, match="MEGA_DISPATCH_WIRE=fp4 contradicts AITER_FORCE_A8W4='1'"):
        select_backends(rocm_facts("gfx1250", force_a8w4="1"), knobs(dispatch_wire="fp4", aiter_force_a8w4=True), A4W4)
    with pytest.raises(KnobError, match="MEGA_DISPATCH_WIRE=fp8 contradicts AITER_FORCE_A8W4=None"):
        select_backends(rocm_facts("gfx1250"), knobs(dispatch_wire="fp8"), A4W4)


def test_aiter_force_a8w4_contradicting_the_models_scheme_is_an_error():
    with pytest.raises(KnobError, match="quant scheme is a8w4 .* set AITER_FORCE_A8W4=1"):
        select_backends(rocm_facts("gfx1250"), knobs(), A8W4)


@pytest.mark.parametrize("raw, parsed", [("true", True), ("", None), ("yes", True)])
def test_aiter_force_a8w4_values_aiter_reads_differently_are_errors(raw, parsed):
    # aiter: os.environ.get("AITER_FORCE_A8W4", "0") in ("1") -- substring test: "" -> fp8, "true" -> fp4
    with pytest.raises(KnobError, match="substring test"):
        select_backends(rocm_facts("gfx1250", force_a8w4=raw), knobs(aiter_force_a8w4=parsed), A4W4)


def test_experts_not_divisible_by_ep_size_is_an_error():
    with pytest.raises(KnobError, match="do not divide over EP size 3"):
        select_backends(rocm_facts("gfx950"), knobs(), A8W4, ep_size=3, num_experts=256)


@pytest.mark.parametrize("transport", ["symm", "ipc"])
def test_the_cuda_p2p_transports_on_rocm_are_an_error(transport):
    with pytest.raises(PlatformError, match=f"MEGA_DISPATCH={transport} is the CUDA device P2P path"):
        select_backends(rocm_facts("gfx950"), knobs(transport=transport), A8W4)


def test_gfx1250_world_size_limit_falls_back():
    sel = select_backends(gfx1250_a8w4(), knobs(aiter_force_a8w4=True), A8W4, ep_size=128, num_experts=256)
    assert not sel.fused and any("world_size <= 72" in r for r in sel.reasons)


def test_gfx1250_old_caps_still_fuse_bf16():
    sel = select_backends(gfx1250_a8w4(GFX1250_CAPS_OLD), knobs(aiter_force_a8w4=True), A8W4)
    assert sel.fused and sel.dispatch_kernel == "flydsl"
    assert GFX1250_CAPS_NEW.has_gfx1250


def test_selection_report_for_megamoe_info(fakes):
    from megamoe_backend.platform import selection_report

    rep = selection_report(knobs(dispatch_wire="fp8", max_tokens_per_rank=512), A8W4, rocm_facts("gfx950"), ep_size=8,
                           num_experts=256, rocm=rocm_ask(shape=R1))
    assert (rep["provider"], rep["transport"], rep["runtime"], rep["dispatch"]) == ("aiter", "mori", "MegaMoEV2", "flydsl")
    assert rep["runtimes"] == ["512:compact/bf16"]
    assert any("mori: 1.2.4" in line for line in rep["platform"]) and rep["reasons"]
    bad = selection_report(knobs(transport="mori"), A8W4, cpu_facts())
    assert "amd-mori" in bad["error"] and "provider" not in bad
