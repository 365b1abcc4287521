"""aiter fused MegaMoE contract: weight shuffles, runtime constructor arguments, shmem / cco order,
one runtime per shape (wire in the key) shared by every layer, each layer's weights reaching it at
every forward, log line. Upstream constraints the fakes add are tested in test_upstream_constraints.py."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from megamoe_backend.transport import PeerInputError
from aiter_helpers import GROUP, E, H, I, K, ask, calls, fused, inputs, layer_weights, make_plan, on_arch, reference, select
from rocm_helpers import GFX1250_CAPS_OLD, knobs, rocm_facts

from megamoe_backend.experts import quantize_expert_weights
from megamoe_backend.experts.aiter import AiterFusedMoE, AiterRuntimeSpec, cached_runtime_keys, rank_major_ids
from megamoe_backend.experts.weights import deinterleave_gate_up
from megamoe_backend.knobs import KnobError
from megamoe_backend.layer.reference import rel_l2
from megamoe_backend.platform import select_backends

# ---- gfx950 / MegaMoEV2 -----------------------------------------------------------------------

def test_v2_weights_go_through_aiters_a16w4_shuffles_from_plain_gate_up_rows(fakes):
    m = fused(fakes, make_plan(), rocm_facts("gfx950"))
    w = layer_weights(0)
    prepared = m.prepare_weights(w)
    sw, ss = calls(fakes.aiter.CALL_LOG, "shuffle_weight_a16w4"), calls(fakes.aiter.CALL_LOG, "shuffle_scale_a16w4")
    e = E // 2
    assert [c[1] for c in sw] == [(e, 2 * I, H // 2), (e, H, I // 2)]
    assert [c[3] for c in sw] == [dict(NLane=16, gate_up=True), dict(NLane=16, gate_up=False)]
    assert torch.equal(sw[0][4], deinterleave_gate_up(w.w1))  # aiter interleaves gate/up itself
    assert [c[1] for c in ss] == [(e * 2 * I, H // 32), (e * H, I // 32)]  # 2-D scales, as aiter's test passes
    assert [c[3] for c in ss] == [dict(experts_cnt=e, gate_up=True), dict(experts_cnt=e, gate_up=False)]
    assert torch.equal(ss[0][4], deinterleave_gate_up(w.w1_scale).reshape(e * 2 * I, H // 32))
    assert prepared.runtime == "MegaMoEV2" and prepared.w1.dtype == torch.uint8


def test_v2_is_built_after_shmem_with_a_power_of_two_mtpr(fakes, caplog):
    plan = make_plan(mtpr=1000, limit=10.0)
    m = fused(fakes, plan, rocm_facts("gfx950"))
    x, ids, w = inputs()
    with caplog.at_level(logging.INFO, logger="megamoe"):
        out = m(x, ids, w, m.prepare_weights(layer_weights(0)))
    assert out.shape == (5, H) and out.dtype == torch.bfloat16
    (_, kwargs), = calls(fakes.aiter.CALL_LOG, "MegaMoEV2")
    assert kwargs == dict(rank=0, world_size=2, model_dim=H, inter_dim=I, experts=E, topk=K, quant="a8w4",
                          max_tok_per_rank=1024, mega_scheme="fixedslot", swiglu_limit=10.0, fixed_slot=False,
                          dev=torch.device("cuda", 0))
    order = [c[0] for c in fakes.mori.CALL_LOG]
    assert order[:4] == ["shmem_get_unique_id", "broadcast_object_list", "shmem_init_attr", "shmem_barrier_all"]
    assert fakes.mori.CALL_LOG[2][1:] == (fakes.mori.shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 2)
    call = m.runtime(None).forward_calls[0]
    assert call["x"].dtype == torch.bfloat16 and call["wts"].dtype == torch.float32 and call["topk_ids"].dtype == torch.int32
    assert "aiter MegaMoEV2" in caplog.text and "wire=fp8" in caplog.text and "mtpr=1024" in caplog.text
    assert "weights=forward-args shared by all layers" in caplog.text


@pytest.mark.parametrize("cls", ["MegaMoEV2", "MegaMoEV2LaunchAttrs"])
def test_v2_shares_one_runtime_and_each_layer_computes_with_its_own_weights(fakes, monkeypatch, cls):
    """4d06fb8d takes each layer's weights as forward arguments; a revision without them gets the four
    launch attributes rebound per forward, as vLLM 0.34 does (mega_moe.py:277-281)."""
    mod = fakes.aiter.ops.flydsl.kernels.mega_moe
    monkeypatch.setattr(mod, "MegaMoEV2", getattr(mod, cls))
    facts = rocm_facts("gfx950")
    layers = [fused(fakes, make_plan(ep=1), facts, layer_id=i) for i in range(3)]
    raw = [layer_weights(i, ep=1) for i in range(3)]
    weights = [m.prepare_weights(w) for m, w in zip(layers, raw)]
    x, ids, tw = inputs()
    outs = [m(x, ids, tw, lw) for m, lw in zip(layers, weights)]
    rt = layers[0].runtime(None)
    assert {m.binding for m in layers} == {"forward-args" if cls == "MegaMoEV2" else "launch-attrs"}
    assert all(m.runtime(None) is rt for m in layers) and len(cached_runtime_keys()) == 1
    assert len(calls(fakes.aiter.CALL_LOG, "MegaMoEV2")) == 1
    assert [c["weights"][0].data_ptr() for c in rt.forward_calls] == [lw.w1.data_ptr() for lw in weights]  # per forward
    assert all(c["layer_weights"] == (cls == "MegaMoEV2") for c in rt.forward_calls)
    for out, w in zip(outs, raw):
        assert rel_l2(out.float(), reference(w, x, ids, tw)) < 1e-2
    assert rel_l2(outs[0].float(), outs[1].float()) > 0.1  # the layers really differ


def test_v2_whose_launch_attributes_changed_is_refused_not_run_on_the_first_layers_weights(fakes, monkeypatch):
    mod = fakes.aiter.ops.flydsl.kernels.mega_moe
    monkeypatch.setattr(mod, "MegaMoEV2", mod.MegaMoEV2LaunchAttrs)
    m = fused(fakes, make_plan(), rocm_facts("gfx950"))
    lw = m.prepare_weights(layer_weights(0))
    x, ids, w = inputs()
    m(x, ids, w, lw)
    del m.runtime(None)._s1_w1  # an aiter revision that renamed it
    with pytest.raises(KnobError, match="'_s1_w1' is None, not w1"):
        m(x, ids, w, lw)


# ---- gfx1250 / MegaMoEGfx1250 -----------------------------------------------------------------

@pytest.fixture
def gfx1250(fakes, monkeypatch):
    return on_arch(fakes, monkeypatch, "gfx1250")


def test_gfx1250_weights_use_moe_shuffles_with_gate_up_interleave(gfx1250):
    m = fused(gfx1250, make_plan(force=True), rocm_facts("gfx1250", force_a8w4="1"))
    w = layer_weights(0)
    m.prepare_weights(w)
    sw, ss = calls(gfx1250.aiter.CALL_LOG, "moe_shuffle_weight"), calls(gfx1250.aiter.CALL_LOG, "moe_shuffle_scale")
    e = E // 2
    assert [c[3]["is_guinterleave"] for c in sw + ss] == [True, False, True, False]
    assert [c[3]["gate_up"] for c in sw + ss] == [True, False, True, False]
    assert {c[3]["experts_cnt"] for c in sw + ss} == {e}
    assert [c[1] for c in ss] == [(e, 2 * I, H // 32), (e, H, I // 32)]
    assert torch.equal(sw[0][4], deinterleave_gate_up(w.w1)) and torch.equal(ss[0][4], deinterleave_gate_up(w.w1_scale))


def test_gfx1250_fp8_wire_runs_mori_dispatch_and_passes_everything_explicitly(gfx1250, monkeypatch, caplog):
    # what aiter would read from the environment if we let it: all wrong on purpose
    monkeypatch.setenv("MEGA_DISPATCH", "auto")
    monkeypatch.setenv("MEGA_DISPATCH_WIRE", "fp4")
    monkeypatch.setenv("MEGA_COMBINE_QUANT", "bogus")
    m = fused(gfx1250, make_plan(wire="fp8", force=True), rocm_facts("gfx1250", force_a8w4="1"))
    x, ids, w = inputs()
    with caplog.at_level(logging.INFO, logger="megamoe"):
        m(x, ids, w, m.prepare_weights(layer_weights(0)))
    (_, kw), = calls(gfx1250.aiter.CALL_LOG, "MegaMoEGfx1250")
    assert (kw["dispatch_backend"], kw["dispatch_wire"], kw["combine_quant"]) == ("mori", "fp8", "none")
    A = gfx1250.aiter
    assert (kw["activation"], kw["gate_mode"], kw["quant_type"]) == (A.ActivationType.Silu, "interleave", A.QuantType.per_1x32)
    assert (kw["max_tokens_per_rank"], kw["experts"], kw["world_size"], kw["swiglu_limit"]) == (512, E, 2, 0.0)
    cco = [c[0] for c in gfx1250.mori.CALL_LOG]
    assert cco == ["cco.get_unique_id", "broadcast_object_list", "cco.init", "cco.barrier", "v2.EpDispatchPlan"]
    assert gfx1250.hip.CALLS == [("hipGetLastError", gfx1250.hip.HIP_ERROR_NOT_SUPPORTED)]  # cleared after cco init
    assert gfx1250.mori.CALL_LOG[2][1:3] == (2, 0)  # Communicator.init(nranks, rank, uid, per_rank_vmm=)
    assert "dispatch=mori" in caplog.text and "wire=fp8" in caplog.text and "a_operand=fp8" in caplog.text


def test_gfx1250_one_runtime_serves_all_layers_with_their_own_weights(gfx1250):
    facts = rocm_facts("gfx1250", force_a8w4="1")
    layers = [fused(gfx1250, make_plan(force=True, ep=1), facts, layer_id=i) for i in range(3)]
    raw = [layer_weights(i, ep=1) for i in range(3)]
    weights = [m.prepare_weights(w) for m, w in zip(layers, raw)]
    x, ids, tw = inputs()
    outs = [m(x, ids, tw, lw) for m, lw in zip(layers, weights)]
    rt = layers[0].runtime(None)
    assert all(m.runtime(None) is rt for m in layers) and len(cached_runtime_keys()) == 1
    assert all(c["w1"] is lw.w1 and c["w2_scale"] is lw.w2_scale for c, lw in zip(rt.forward_calls, weights))
    assert {c["combine_quant"] for c in rt.forward_calls} == {"none"}
    assert len(calls(gfx1250.mori.CALL_LOG, "cco.init")) == 1
    for out, w in zip(outs, raw):
        assert rel_l2(out.float(), reference(w, x, ids, tw)) < 1e-2


def test_gfx1250_runtime_cache_key_includes_the_wire(gfx1250):
    facts = rocm_facts("gfx1250", force_a8w4="1")
    x, ids, w = inputs()
    for wire in ("bf16", "fp8"):
        m = fused(gfx1250, make_plan(wire=wire, force=True), facts)
        m(x, ids, w, m.prepare_weights(layer_weights(0)))
    keys = cached_runtime_keys()
    at = list(AiterRuntimeSpec.__dataclass_fields__).index("dispatch_wire")
    assert len(keys) == 2 and {k[at] for k in keys} == {"bf16", "fp8"}


def test_gfx1250_fp8_combine_is_built_and_asked_for_per_step(gfx1250):
    m = fused(gfx1250, make_plan(wire="fp8", force=True, combine="fp8_blockwise_1x32"), rocm_facts("gfx1250", force_a8w4="1"))
    x, ids, w = inputs()
    m(x, ids, w, m.prepare_weights(layer_weights(0)))
    (_, kw), = calls(gfx1250.aiter.CALL_LOG, "MegaMoEGfx1250")
    assert (kw["dispatch_wire"], kw["combine_quant"]) == ("fp8", "mxfp8")
    assert m.runtime(None).forward_calls[0]["combine_quant"] == "mxfp8"  # no bound: the warm-up shape, quantised


def test_gfx1250_quantised_combine_is_named_on_large_steps_only(gfx1250, caplog):
    """22f2e2dc builds the quantised reduce at construction but a step runs it only when it names it ("a
    quantized wire only pays off once there are enough tokens on it"); ATOM names it on prefill steps only
    (combine_quant_for_step). A step whose (rank-agreed) bound is <= 1024 tokens per rank runs bf16. On the
    old code (combine_quant sent every step) this test FAILS (a 4-token step asks for mxfp8)."""
    from megamoe_backend.platform.rocm_rules import gfx1250_step_combine_quant

    assert [gfx1250_step_combine_quant("mxfp8", b) for b in (None, 4, 1024, 1025)] == ["mxfp8", "none", "none", "mxfp8"]
    assert gfx1250_step_combine_quant("none", None) == "none"
    m = fused(gfx1250, make_plan(wire="fp8", force=True, combine="fp8_blockwise_1x32", mtpr=2048),
              rocm_facts("gfx1250", force_a8w4="1"))
    x, ids, w = inputs()
    lw = m.prepare_weights(layer_weights(0))
    with caplog.at_level(logging.INFO, logger="megamoe"):
        m(x, ids, w, lw, bound=5)
        m(x, ids, w, lw, bound=2048)
    assert [c["combine_quant"] for c in m.runtime(None).forward_calls] == ["none", "mxfp8"]
    line = next(r.getMessage() for r in caplog.records if "aiter MegaMoEGfx1250:" in r.getMessage())
    # ATOM's "[MORI-V2] Created MegaMoE: ... dispatch=%s stage1_fused=%s wire=%s combine_quant=%s force_a8w4=%s"
    for field in ("dispatch=mori", "stage1_fused=False", "wire=fp8", "combine_quant=mxfp8", "force_a8w4=1"):
        assert f" {field} " in line, (field, line)


def test_gfx1250_published_e4048607_api_with_bf16_wire(fakes, monkeypatch):
    fakes.aiter.reset("gfx1250")
    monkeypatch.setenv("AITER_FORCE_A8W4", "1")
    m = fused(fakes, make_plan(wire="bf16", force=True), rocm_facts("gfx1250", caps=GFX1250_CAPS_OLD, force_a8w4="1"))
    x, ids, w = inputs()
    m(x, ids, w, m.prepare_weights(layer_weights(0)))
    (_, kw), = calls(fakes.aiter.CALL_LOG, "MegaMoEGfx1250")
    assert kw["dispatch_backend"] == "flydsl" and kw["dispatch_wire"] == "bf16"  # fake reports its fixed bf16 wire


def test_a_quantised_wire_on_an_aiter_without_dispatch_wire_is_refused_not_shipped_as_bf16(fakes, monkeypatch):
    from rocm_helpers import use_scale_row_mori

    use_scale_row_mori(fakes, monkeypatch)
    fakes.aiter.reset("gfx1250")
    plan = make_plan(wire="fp8", force=True)
    facts = rocm_facts("gfx1250", force_a8w4="1")  # claims the new API; the installed class is the old one
    m = fused(fakes, plan, facts)
    x, ids, w = inputs()
    with pytest.raises(KnobError, match="no dispatch_wire argument"):
        m(x, ids, w, m.prepare_weights(layer_weights(0)))


# ---- bad input ---------------------------------------------------------------------------------

def test_unfused_selection_is_refused(fakes):
    plan = make_plan()
    sel = select(plan, rocm_facts("gfx950"), device_index=1)  # ep_rank 0 on cuda:1: MegaMoEV2 would use cuda:0
    with pytest.raises(KnobError, match="cannot run this plan"):
        AiterFusedMoE(plan, GROUP, selection=sel)


def test_too_many_tokens_wrong_weights_and_a_wrong_out_are_refused(fakes):
    m = fused(fakes, make_plan(mtpr=4), rocm_facts("gfx950"))
    lw = m.prepare_weights(layer_weights(0))
    x, ids, w = inputs(5)
    with pytest.raises(ValueError, match="exceed max_tok_per_rank=4"):
        m(x, ids, w, lw)
    with pytest.raises(ValueError, match="prepared for MegaMoEGfx1250"):
        m(x[:2], ids[:2], w[:2], SimpleNamespace(**{**lw.__dict__, "runtime": "MegaMoEGfx1250"}))
    with pytest.raises(ValueError, match=r"out must be bf16 \(2, 128\)"):
        m(x[:2], ids[:2], w[:2], lw, out=torch.empty(2, H))
    bf16 = quantize_expert_weights(torch.randn(E // 2, 2 * I, H), torch.randn(E // 2, H, I), "bf16")
    with pytest.raises(ValueError, match="MXFP4 expert weights"):
        m.prepare_weights(bf16)


def test_v2_rejecting_a_configuration_names_it(fakes, monkeypatch):
    from rocm_helpers import V2_CAPS

    from megamoe_backend.platform.facts import AiterCaps

    from rocm_helpers import use_a4w4_plan_builder

    use_a4w4_plan_builder(fakes, monkeypatch)  # the plan builder plans fp4, the constructor still says no
    caps = AiterCaps(V2_CAPS.v2_init, V2_CAPS.v2_forward, v2_accepts_a4w4=True)
    m = fused(fakes, make_plan(wire="fp4", quant="a4w4"), rocm_facts("gfx950", caps=caps))
    x, ids, w = inputs()
    with pytest.raises(KnobError, match="MegaMoEV2 rejected the configuration .*a8w4' only"):
        m(x, ids, w, m.prepare_weights(layer_weights(0)))


def test_rank_major_ids_follow_the_placement_and_fill_masked_entries():
    owner = torch.tensor([1, 0, 1, 0]); slot = torch.tensor([0, 0, 1, 1])  # non-linear placement, 2 per rank
    topk = torch.tensor([[0, 3], [2, -1], [-1, -1], [1, 7]])  # 7: a bad id, never used as an index
    tw = torch.tensor([[0.5, 0.5], [1.0, 9.0], [1.0, 1.0], [0.25, 4.0]])
    ids, w = rank_major_ids(topk, tw, owner, slot, 2)
    assert ids.dtype == torch.int32 and ids.is_contiguous()
    assert ids.tolist() == [[2, 1], [3, 3], [0, 0], [0, 0]]
    assert w.tolist() == [[0.5, 0.5], [1.0, 0.0], [0.0, 0.0], [0.25, 0.0]]
    assert knobs().transport == "auto"


def test_megamoe_layer_runs_the_shared_fused_runtime_over_a_real_process_group(fakes, tmp_path):
    """The layer's fused branch end to end on CPU: a one-rank gloo group (torch's own
    broadcast_object_list for the shmem bootstrap), two layers on one MegaMoEV2, an idle step."""
    import torch.distributed as dist

    from megamoe_backend.layer.megamoe_layer import MegaMoELayer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        plan = make_plan(ep=1)
        plan = dataclasses.replace(plan, backends=select(plan, rocm_facts("gfx950")))
        raw = [layer_weights(i, ep=1) for i in range(2)]
        layers = [MegaMoELayer(plan, w, group=group, layer_id=i) for i, w in enumerate(raw)]
        x, ids, tw = inputs()
        outs = [layer(x, ids, tw) for layer in layers]
        assert len(cached_runtime_keys()) == 1 and len(calls(fakes.aiter.CALL_LOG, "MegaMoEV2")) == 1
        for out, w in zip(outs, raw):
            assert rel_l2(out.float(), reference(w, x, ids, tw)) < 1e-2
        assert layers[0](x[:0], ids[:0], tw[:0]).shape == (0, H)  # 4d06fb8d: an empty step is a real call
        runtime = layers[0].fused.runtime(None)
        assert runtime.forward_calls[-1]["x"].shape == (0, H)
        # a bad id runs nowhere (a zero-weight copy of a valid id) and goes to the status word; the step's collective
        # completes on every rank, then this rank raises it (on CPU the host copy is current at once)
        bad = ids.clone()
        bad[1, 0] = 10**6
        before = len(runtime.forward_calls)
        with pytest.raises(ValueError, match=r"layer 0: topk_ids holds 1000000 at token 1"):
            layers[0](x, bad, tw)
        sent = runtime.forward_calls[before:]
        assert len(sent) == 1 and bool((sent[0]["topk_ids"] >= 0).all()) and sent[0]["wts"][1, 0] == 0
        assert sent[0]["mask_invalid_slots"] is None
        assert torch.isfinite(layers[0](x, ids, tw)).all()  # reported once, then cleared
        # a shape problem is known on the host: this rank still enters the collective (as an idle rank), then raises
        with pytest.raises(PeerInputError, match=r"topk_ids / topk_weights must be .*idle rank"):
            layers[0](x, ids[:, :1], tw)
        assert runtime.forward_calls[-1]["x"].shape == (0, H)
    finally:
        dist.destroy_process_group()
