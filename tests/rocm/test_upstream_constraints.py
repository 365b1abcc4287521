"""Upstream constraints the fakes copy, each with the test that the adapter honours it.

Pinned revisions (docs/rocm.md): ROCm/aiter 4d06fb8d for MegaMoEV2 and its plan builder (what
vLLM 0.34's aiter_mega_moe calls), e4048607 for MegaMoEGfx1250 and the heap list, ROCm/mori
624002c8 (+ #593's scale row where named), vLLM 0.34.0 (wheel sources).

Each docstring names the upstream line the fake copies and the mutant of today's adapter the test
catches: ``tests/rocm/mutants.py`` plants each one in a copy of the tree (the old behaviour behind
today's signatures, so a failure is the behaviour, not a TypeError) and runs the test there. The
outcome of one run of all 33 (tests/rocm/mutants.py, 2026-12-04, on this tree) is written as
"mutant X: FAILS (...)" -- every mutant named here failed its test on that run. The mori-transport constraints (InterNodeV1 blockwise combine, gfx1250
A4W4 unfused) live in test_mori_transport.py, the sync-free mori forward in test_mori_device_forward.py.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from aiter_helpers import E, H, I, K, ask, calls, fused, inputs, layer_weights, make_plan, on_arch, reference, select
from rocm_helpers import R1, V4_FLASH, V4_PRO, FakeDist, FakeGroup, knobs, rocm_ask, rocm_facts, use_scale_row_mori
from sync_guard import no_host_sync

from megamoe_backend.experts.aiter import MoriHeap, cached_runtime_keys, prepare_gfx1250_weights, v2_shmem_bytes
from megamoe_backend.experts.aiter.heap import heap_to_set
from megamoe_backend.experts.aiter.routing import rank_major_ids
from megamoe_backend.experts.base import ExpertMath
from megamoe_backend.knobs import KnobError
from megamoe_backend.layer.reference import rel_l2
from megamoe_backend.platform import select_backends
from megamoe_backend.plan.forward_choice import ForwardFacts, choose_forward
from megamoe_backend.transport import TransportError
from megamoe_backend.transport.mori import init_mori_shmem, pick_kernel

GIB = 1 << 30
A8W4 = ExpertMath("a8w4")


def v2_select(fakes, knobs_, shape=V4_PRO, ep_size=8, num_experts=384, **kw):
    return select_backends(rocm_facts("gfx950"), knobs_, A8W4, ep_size=ep_size, num_experts=num_experts,
                           rocm=rocm_ask(shape=shape, **kw))


def fake_v2_heap_bytes(fakes, world=1, hidden=H, experts=E, topk=K, mtpr=512, inter=I) -> int:
    """Bytes the fake MegaMoEV2 takes from a fresh fake heap, allocation by allocation as upstream."""
    shmem = fakes.mori.shmem
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, world, shmem.shmem_get_unique_id())
    before = shmem.heap_used()
    w = torch.zeros(1, dtype=torch.uint8)  # the constructor only stores weights
    fakes.aiter.ops.flydsl.kernels.mega_moe.MegaMoEV2(
        rank=0, world_size=world, model_dim=hidden, inter_dim=inter, experts=experts, topk=topk, quant="a8w4",
        w1=w, w1_scale=w, w2=w, w2_scale=w, max_tok_per_rank=mtpr)
    used = shmem.heap_used() - before
    shmem.shmem_finalize()
    fakes.mori.CALL_LOG.clear()
    fakes.aiter.CALL_LOG.clear()
    return used


# ---- aiter's plan builder at start-up (4d06fb8d mega_moe_config.py; vLLM 0.34 mega_moe.py:164-190) -------------

def test_selection_asks_the_installed_plan_builder_and_holds_vllm_034s_two_runtimes(fakes):
    """vLLM 0.34 builds a runtime at next_power_of_2(max_num_batched_tokens) and, where
    build_mega_moe_bundle_plan(prev_power_of_2(FIXED_SLOT_MAX_MTPR), experts_per_rank=, model_dim=,
    inter_dim=, world_size=).fixed_slot_dispatch, one at 128 (mega_moe.py:164-190); the fake builder
    copies 4d06fb8d (_use_fixed_slots: (8, 48), (4, 96), (2, 192)). V4 Pro at EP 8 gets both, R1
    (32 experts per rank) one. Mutant ``v2-one-runtime`` (selection keeps only the max runtime, as
    before this issue): FAILS (AssertionError on the runtimes)."""
    sel = v2_select(fakes, knobs())
    assert [r.describe() for r in sel.runtimes] == ["128:fixed-slot/bf16", "8192:compact/fp8_blockwise_1x32"]
    asked = [c[1] for c in calls(fakes.aiter.CALL_LOG, "build_mega_moe_bundle_plan")]
    assert asked == [dict(mtpr=8192, experts_per_rank=48, model_dim=7168, inter_dim=3072, world_size=8),
                     dict(mtpr=128, experts_per_rank=48, model_dim=7168, inter_dim=3072, world_size=8)]
    r1 = v2_select(fakes, knobs(), shape=R1, num_experts=256)
    assert [r.describe() for r in r1.runtimes] == ["8192:compact/fp8_blockwise_1x32"]
    assert any("no fixed-slot dispatch for EP 8 x 32 experts per rank" in r for r in r1.reasons)


def test_the_fixed_slot_knob_reaches_the_plan_and_the_heap(fakes, monkeypatch):
    """AITER_MEGA_FIXED_SLOT_MAX_MTPR (4d06fb8d envs.py:28, read once by mega_moe_config.py:35): 511
    admits the 256-token capacity, so the decode runtime is 256 fixed-slot; the heap is that plan's
    (fixed-slot buffers are sized per expert slot, compact ones per routed pair). Mutant
    ``heap-threshold`` (heap.py sizing by ``mtpr > 255`` as before, not by the plan): FAILS (the 256
    runtime is counted compact)."""
    monkeypatch.setenv("AITER_MEGA_FIXED_SLOT_MAX_MTPR", "511")
    importlib.reload(fakes.aiter.ops.flydsl.kernels.mega_moe.mega_moe_config)
    sel = v2_select(fakes, knobs(max_tokens_per_rank=4096))
    assert [r.describe() for r in sel.runtimes] == ["256:fixed-slot/bf16", "4096:compact/fp8_blockwise_1x32"]
    fixed = v2_shmem_bytes(8, 7168, 48, 6, 256, True)
    assert fixed != v2_shmem_bytes(8, 7168, 48, 6, 256, False)
    assert fake_v2_heap_bytes(fakes, world=8, hidden=7168, experts=384, topk=6, mtpr=256, inter=3072) <= fixed
    from megamoe_backend.experts.aiter.runtime import AiterRuntimeSpec

    spec = AiterRuntimeSpec("MegaMoEV2", 0, 8, 7168, 3072, 384, 6, 256, "a8w4", 0.0, "flydsl", "fp8", "none", "fp8",
                            fixed_slot=True)
    assert spec.shmem_bytes() == fixed


@pytest.mark.parametrize("case, expect", [
    (dict(knobs_=dict(max_tokens_per_rank=65536)), "mtpr=65536 has no exact token bucket"),
    (dict(shape=V4_FLASH, ep_size=8), "DeepSeek-V4.1-Flash MegaMoE requires EP2 or EP4"),
    (dict(shape=R1, ep_size=1, num_experts=384), "at most 256 experts per rank"),
    (dict(shape=R1, ep_size=16, num_experts=256), "world_size must be in [1, 8], got 16"),
])
def test_cases_the_installed_aiter_refuses_run_unfused_naming_the_knob(fakes, case, expect):
    """Each refusal of 4d06fb8d's builder (mega_moe_config.py: TOKEN_BUCKETS 13-29 and "has no exact
    token bucket"; select_mega_moe_config's V4-Flash EP 2 / 4 rule, world_size in [1, 8],
    MAX_FANOUT_EXPERTS_PER_RANK = 256 at line 46) is a start-up decision: unfused over mori with
    aiter's words and the knobs, never a runtime built lazily that fails at the first forward.
    Mutant ``v2-no-plan-builder`` (the probe answers a single runtime without asking aiter, as the
    adapter did): FAILS (fused where aiter refuses). V4-Flash at EP 4 fuses."""
    k = knobs(**case.pop("knobs_", {}))
    sel = v2_select(fakes, k, **case)
    assert (sel.fused, sel.transport) == (False, "mori")
    why = next(r for r in sel.reasons if "refused" in r)
    assert expect in why and "MEGA_MAX_TOKENS_PER_RANK=" in why and "EP size" in why
    assert v2_select(fakes, knobs(), shape=V4_FLASH, ep_size=4).fused


def test_topk_above_16_is_not_fused():
    """MegaMoEV2 refuses top-k outside [1, 16] in its constructor (4d06fb8d mega_moe_v2.py:57-58).
    Mutant ``v2-no-topk-limit``: FAILS (fused at top-k 20)."""
    from megamoe_backend.platform import MoEShape

    sel = select_backends(rocm_facts("gfx950"), knobs(), A8W4, ep_size=8, num_experts=384,
                          rocm=rocm_ask(shape=MoEShape(7168, 3072, 20)))
    assert not sel.fused and any("top-k in [1, 16]" in r for r in sel.reasons)


def test_mi355x_with_the_default_knobs_runs_fused(fakes):
    """Upstream runs the fused MegaMoEV2 by default (vLLM 0.34 --moe-backend aiter_mega_moe; SGLang
    --moe-a2a-backend megamoe). With MEGA_DISPATCH_WIRE / MEGA_COMBINE_WIRE at their bf16 defaults the
    selection was triton + mori. Mutant ``v2-fp8-wire-only`` (the old rule: fused only with
    MEGA_DISPATCH_WIRE=fp8): FAILS (not fused)."""
    sel = v2_select(fakes, knobs())
    assert (sel.provider, sel.runtime, sel.dispatch_wire, sel.combine_wire) == ("aiter", "MegaMoEV2", "fp8",
                                                                                  "fp8_blockwise_1x32")


# ---- MegaMoEV2.forward (4d06fb8d): config_tokens, per-layer weights, T = 0, mask_invalid_slots, cuda:<rank> ------

def test_each_step_runs_the_smallest_runtime_holding_the_bound_with_config_tokens_and_a_bf16_decode_combine(fakes):
    """vLLM 0.34 picks the runtime per step from dp_metadata's max token count (mega_moe.py:225-238);
    here from the engine's token bound, the same on every rank, passed as ``config_tokens`` ("must
    agree across ranks and cover their source counts", 4d06fb8d MegaMoEV2.forward) -- so every rank
    launches the same bundle entry, and the decode runtime's P2P combine is bf16 (p2p_quant "none"
    while mtpr <= 1024, mega_moe_config.py:32) where the max one quantises to fp8. The layer: 384
    experts at EP 2, aiter's (2, 192) fixed-slot geometry, so the fake builder plans 128 fixed-slot +
    4096 compact. Mutants ``v2-no-config-tokens`` (config_tokens not passed) and
    ``v2-max-runtime-always`` (every step on the largest runtime, as before): both FAIL."""
    plan = make_plan(ep=2, mtpr=4096, experts=384)
    m = fused(fakes, plan, rocm_facts("gfx950"))
    assert [r.describe() for r in m.selection.runtimes] == ["128:fixed-slot/bf16", "4096:compact/fp8_blockwise_1x32"]
    w = layer_weights(0, ep=2, experts=384)
    lw = m.prepare_weights(w)
    x, ids, tw = inputs()  # ids < 8: every route is rank 0's, so its share is the whole answer
    want = reference(w, x, ids, tw)
    decode = m(x, ids, tw, lw, bound=8)
    prefill = m(x, ids, tw, lw, bound=512)
    unbound = m(x, ids, tw, lw)
    small, big = m.runtime(lw, 8), m.runtime(lw, 512)
    assert small is not big and (small.mtpr, big.mtpr) == (128, 4096) and len(cached_runtime_keys()) == 2
    assert [(c["config_tokens"], c["bucket"], c["p2p_quant"]) for c in small.forward_calls] == [(8, 8, "none")]
    assert [(c["config_tokens"], c["p2p_quant"]) for c in big.forward_calls] == [(512, "fp8_blockwise_1x32"),
                                                                                (4096, "fp8_blockwise_1x32")]
    assert rel_l2(decode.float(), want) < 5e-3 < rel_l2(prefill.float(), want)  # the fp8 combine is lossy
    assert torch.equal(prefill, unbound)


def test_layer_weights_reach_the_runtime_as_forward_arguments_aiter_checks(fakes):
    """4d06fb8d MegaMoEV2.forward takes w1 / w1_scale / w2 / w2_scale and refuses ones that do not match
    the prepared geometry (one byte per element, numel, device, contiguous). Mutant
    ``v2-launch-attrs-only`` (weights rebound as launch attributes even where the forward takes
    them): FAILS (binding launch-attrs: no layer weights in the forward call)."""
    m = fused(fakes, make_plan(ep=1), rocm_facts("gfx950"))
    lw = m.prepare_weights(layer_weights(0, ep=1))
    x, ids, tw = inputs()
    m(x, ids, tw, lw)
    assert m.binding == "forward-args" and m.runtime(lw).forward_calls[-1]["layer_weights"]
    rt = m.runtime(lw)
    with pytest.raises(ValueError, match="must match the prepared geometry"):  # what aiter says for a wrong tensor
        rt.forward(x.to(torch.bfloat16), tw.float(), ids.int(), w1=lw.w1[:1], w1_scale=lw.w1_scale, w2=lw.w2,
                   w2_scale=lw.w2_scale)


def test_megamoev2_on_another_gpu_than_its_ep_rank_is_refused_at_start_up(fakes):
    """MegaMoEV2 allocates on torch.device("cuda", rank) (4d06fb8d mega_moe_v2.py:74; e4048607 intranode
    op 412, 555): with two EP groups per node, or one visible GPU per process, ep_rank 1 runs on cuda:0
    and aiter's buffers land on cuda:1 -- the fake's per-layer weight check then fails as aiter's does.
    Selection runs that layout unfused and AiterFusedMoE refuses it. Mutant ``v2-no-device-check``:
    FAILS (selected fused on cuda:0 for ep_rank 1)."""
    plan = make_plan(rank=1)
    sel = select(plan, rocm_facts("gfx950"), device_index=0)
    assert not sel.fused and any("allocates on cuda:1 (its EP rank" in r and "cuda:0" in r for r in sel.reasons)
    assert select(plan, rocm_facts("gfx950"), device_index=1).fused
    from megamoe_backend.experts.aiter import AiterFusedMoE

    with pytest.raises(KnobError, match="allocates on cuda:1"):
        AiterFusedMoE(plan, None, "cuda:0", selection=select(plan, rocm_facts("gfx950")))
    rt_cls = fakes.aiter.ops.flydsl.kernels.mega_moe.MegaMoEV2  # what aiter does with it: the device check fails
    shmem = fakes.mori.shmem
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 1, 2, shmem.shmem_get_unique_id())
    lw = prepare_gfx1250_weights(layer_weights(0), fakes.aiter.ops.shuffle)
    rt = rt_cls(rank=1, world_size=2, model_dim=H, inter_dim=I, experts=E, topk=K, quant="a8w4", w1=lw.w1,
                w1_scale=lw.w1_scale, w2=lw.w2, w2_scale=lw.w2_scale, max_tok_per_rank=512)
    x, ids, tw = inputs()
    with pytest.raises(ValueError, match="must match the prepared geometry"):
        rt.forward(x.to(torch.bfloat16), tw.float(), ids.int(), w1=lw.w1, w1_scale=lw.w1_scale, w2=lw.w2,
                   w2_scale=lw.w2_scale)


@pytest.mark.parametrize("arch", ["gfx950", "gfx1250"])
def test_an_idle_rank_takes_part_in_the_collective(fakes, monkeypatch, arch):
    """4d06fb8d allows T = 0 (``entry_for_tokens(0)`` takes the first bucket: "Empty DP ranks must still
    launch the same collective MegaMoE protocol", mega_moe_config.py MegaMoEBundlePlan), so the idle
    rank calls it with no rows; MegaMoEGfx1250 has never run T = 0, so it gets SGLang's one zero-weight
    token (mega_moe_aiter.py, 33035b64). Mutant ``idle-returns-early`` (an idle rank skips the
    runtime): FAILS (no call: its peers would wait in the kernel)."""
    on_arch(fakes, monkeypatch, arch)
    m = fused(fakes, make_plan(force=True), rocm_facts(arch, force_a8w4="1"))
    lw = m.prepare_weights(layer_weights(0))
    x, ids, tw = inputs()
    out = m(x[:0], ids[:0], tw[:0], lw)
    assert out.shape == (0, H) and out.dtype == torch.bfloat16
    call = m.runtime(lw).forward_calls[-1]
    sent = call["x"]
    if arch == "gfx950":
        assert sent.shape == (0, H) and call["config_tokens"] == 512
    else:
        assert sent.shape == (1, H) and not sent.any() and not call["wts"].any()
    assert m(x, ids, tw, lw).shape == (5, H)  # and the next step is an ordinary one


def test_masked_entries_reach_the_runtime_as_zero_weight_copies_without_the_per_step_mask(fakes):
    """4d06fb8d leaves ``mask_invalid_slots`` off by default, "because the id check costs prefill time;
    callers that pad with -1 ask for it per call" (aiter mega_moe/envs.py, AITER_MEGA_COMBINE_MASK), and
    vLLM 0.34 passes nothing. The adapter hands on no -1 (a masked entry is a zero-weight copy of a
    valid id), so it never needs the mask and never asks for it. On the old code (``mask_invalid_slots=
    True`` every step, -1 kept) this test FAILS (the call carries the mask and a -1)."""
    m = fused(fakes, make_plan(ep=1), rocm_facts("gfx950"))
    w = layer_weights(0, ep=1)
    lw = m.prepare_weights(w)
    x, ids, tw = inputs()
    ids[1, 1] = -1
    out = m(x, ids, tw, lw)
    call = m.runtime(lw).forward_calls[-1]
    assert call["mask_invalid_slots"] is None and bool((call["topk_ids"] >= 0).all())
    assert call["wts"][1, 1] == 0
    assert torch.isfinite(out).all() and rel_l2(out.float(), reference(w, x, ids, tw)) < 5e-3


def test_the_fused_forward_makes_no_host_sync_and_can_be_captured(fakes, tmp_path):
    """No ``bool(valid.all())`` on the ids (experts/aiter/routing.py before this issue, line 24), no host
    read of the ids in the layer: bad ids go to the status word on the device. Mutants
    ``routing-host-sync`` (the old ``if not bool(valid.all())``), ``fused-host-id-check`` (the
    layer's host_input_status on the ids, as before) and ``id-check-scalar-index`` (``ids[first]``
    with a 0-d index, the sync an H200 run under set_sync_debug_mode("error") found in the first
    version of id_check.py): all FAIL (HostSyncError)."""
    import dataclasses

    import torch.distributed as dist

    from megamoe_backend.layer.megamoe_layer import MegaMoELayer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        plan = make_plan(ep=1)
        plan = dataclasses.replace(plan, backends=select(plan, rocm_facts("gfx950")))
        layer = MegaMoELayer(plan, layer_weights(0, ep=1), group=dist.new_group([0]))
        x, ids, tw = inputs()
        ids[0, 0] = -1
        with no_host_sync():
            out = layer(x, ids, tw, max_tokens_across_ranks=8)
        assert out.shape == (5, H) and layer.takes_token_bound and layer.forward_choice.forward == "fused"
    finally:
        dist.destroy_process_group()
    assert choose_forward(ForwardFacts("rocm", "aiter", "mori", 8, True)).capturable
    assert choose_forward(ForwardFacts("rocm", "triton", "mori", 8, False)).capturable


def test_rank_major_ids_make_no_host_sync():
    """Mutant ``routing-host-sync``: FAILS (HostSyncError at routing.py)."""
    owner, slot = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1])
    with no_host_sync():
        ids, _ = rank_major_ids(torch.tensor([[0, -1], [3, 9]]), torch.ones(2, 2), owner, slot, 2)
    assert ids.tolist() == [[0, 0], [3, 3]]


# ---- mori: the scale row (ROCm/mori#593), the stale HIP error (#761), InterNodeV1LL (vLLM 0.34) ---------------------

def test_the_scale_row_probe_asks_moris_hip_backend_where_aiter_does(fakes, monkeypatch):
    """aiter's MegaMoEGfx1250 asks mori for the scale row's stride with ``from
    mori.ops.dispatch_combine_v2.hip_backend import scale_stride_bytes`` (22f2e2dc
    ``MegaMoEConfig.dispatch_scale_dst_nbytes``) and builds ``EpDispatchPlan(scale_bytes=)``; ROCm/mori#593
    adds both, 624002c8 has neither (its HIP backend refuses scale rows, hip_backend.py:176-177). The
    probe asks the same module. On the old code (it looked for ``scale_stride_bytes`` on
    ``EpDispatchCombineConfig``, which no mori has) this test FAILS: a #593 mori reads as "no row".
    Mutant ``no-scale-row-probe`` (the probe always says yes): FAILS (624002c8 reads as "row")."""
    from megamoe_backend.platform.rocm_probes import installed_mori_scale_row

    fakes.aiter.reset("gfx1250")
    monkeypatch.setenv("AITER_FORCE_A8W4", "1")
    mod = fakes.aiter.ops.flydsl.kernels.mega_moe_gfx1250
    monkeypatch.setattr(mod, "MegaMoEGfx1250", mod.MegaMoEGfx1250_22f2e2dc)
    build = dict(communicator=object(), rank=0, world_size=2, model_dim=H, inter_dim=I, experts=E, topk=K,
                 max_tokens_per_rank=8, dispatch_backend="mori", dispatch_wire="fp8")
    assert not installed_mori_scale_row()
    with pytest.raises(RuntimeError, match=r"needs a mori whose EP dispatch carries a per-token scale row"):
        mod.MegaMoEGfx1250(**build)  # what aiter's build does on 624002c8
    mori_asked = make_plan(wire="fp8", force=True, transport="mori")
    sel = select(mori_asked, rocm_facts("gfx1250", force_a8w4="1"))
    assert not sel.fused and any("hip_backend.scale_stride_bytes" in r for r in sel.reasons)
    use_scale_row_mori(fakes, monkeypatch)
    assert installed_mori_scale_row()
    mod.MegaMoEGfx1250(**build)
    sel = select(mori_asked, rocm_facts("gfx1250", force_a8w4="1"))
    assert (sel.fused, sel.dispatch_kernel, sel.stage1_fused) == (True, "mori", False)


def test_the_hip_error_cco_init_leaves_is_cleared_before_the_runtime_allocates(fakes, monkeypatch):
    """cco's hipMemCreate probe leaves hipErrorNotSupported as the HIP last error; the next torch call
    that checks it raises it; mori clears it only since ROCm/mori#761 (unreleased) and vLLM 0.34 clears
    it after every cco init (all2all.py:1127-1131). Mutant ``no-hip-clear`` (clear_hip_last_error does
    nothing): FAILS (the fake runtime's first allocation raises)."""
    on_arch(fakes, monkeypatch, "gfx1250")
    m = fused(fakes, make_plan(force=True), rocm_facts("gfx1250", force_a8w4="1"))
    lw = m.prepare_weights(layer_weights(0))
    x, ids, tw = inputs()
    assert m(x, ids, tw, lw).shape == (5, H)
    assert fakes.hip.CALLS == [("hipGetLastError", fakes.hip.HIP_ERROR_NOT_SUPPORTED)]
    fakes.hip.LAST_ERROR["code"] = fakes.hip.HIP_ERROR_NOT_SUPPORTED
    with pytest.raises(RuntimeError, match="hipErrorNotSupported"):  # what an uncleared error does
        fakes.hip.raise_if_pending("an allocation")


def test_gfx1250_recv_token_bound_reaches_the_runtime(fakes, monkeypatch):
    """MegaMoEGfx1250.forward(recv_token_bound=) (e4048607 mega_moe.py:335-346) shrinks the GEMM grid to
    a static bound; ATOM passes graph_bs * topk * dp (mori_v2_prepare_finalize.py:512-535, 587-590).
    Here: the token bound x top-k x EP size, below the arena only, none without a bound. Mutant
    ``no-recv-bound`` (never passed): FAILS."""
    on_arch(fakes, monkeypatch, "gfx1250")
    m = fused(fakes, make_plan(force=True), rocm_facts("gfx1250", force_a8w4="1"))
    lw = m.prepare_weights(layer_weights(0))
    x, ids, tw = inputs()
    m(x, ids, tw, lw, bound=8)
    m(x, ids, tw, lw)
    assert [c["recv_token_bound"] for c in m.runtime(lw).forward_calls] == [8 * K * 2, None]


def test_multi_node_mori_takes_internode_v1_ll_for_small_budgets_with_vllms_geometry():
    """vLLM 0.34 MoriAll2AllManager._make_all2all_kwargs (all2all.py:989-1020): one node IntraNode with 16
    warps x 80 blocks; across nodes InterNodeV1LL while the per-rank token budget is at most
    VLLM_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD (256, envs.py:306), else InterNodeV1, with
    (warps, blocks, rdma blocks) (16, 32, 16) on gfx942 and (8, 64, 32) on gfx950. Mutant
    ``always-internode-v1`` (the old pick): FAILS."""
    assert pick_kernel(8, 8, 8192, "gfx950").config_fields() == dict(warp_num_per_block=16, block_num=80, rdma_block_num=0)
    ll = pick_kernel(16, 8, 256, "gfx950")
    assert (ll.kernel_type, ll.gpu_per_node, ll.config_fields()) == (
        "InterNodeV1LL", 8, dict(warp_num_per_block=8, block_num=64, rdma_block_num=32))
    assert pick_kernel(16, 8, 257, "gfx942").kernel_type == "InterNodeV1"
    assert pick_kernel(16, 8, 257, "gfx942").config_fields() == dict(warp_num_per_block=16, block_num=32, rdma_block_num=16)
    assert pick_kernel(16, 8, 64, "gfx1250").config_fields() == {}  # no numbers upstream: mori's defaults


# ---- mori's symmetric heap (mori tensor_utils.py:50, init.cpp:223-227, memory.cpp:37; vLLM all2all.py:951-966) ------

def test_layers_share_one_v2_runtime_inside_a_heap_one_per_layer_would_exhaust(fakes, monkeypatch):
    """Before issue 34: one MegaMoEV2 per layer; the second layer's construction hit `AssertionError:
    mori_shmem.shmem_malloc failed` in the fake heap, as on a gfx950 with 60 layers. Mutant
    ``runtime-per-layer`` (the layer id in the runtime cache key): FAILS (shmem_malloc failed)."""
    monkeypatch.setenv("MORI_SHMEM_HEAP_SIZE", str(fake_v2_heap_bytes(fakes) * 3 // 2))
    facts = rocm_facts("gfx950")
    layers = [fused(fakes, make_plan(ep=1), facts, layer_id=i) for i in range(3)]
    raw = [layer_weights(i, ep=1) for i in range(3)]
    x, ids, tw = inputs()
    for m, w in zip(layers, raw):
        assert rel_l2(m(x, ids, tw, m.prepare_weights(w)).float(), reference(w, x, ids, tw)) < 1e-2
    assert len(cached_runtime_keys()) == 1 and not calls(fakes.mori.CALL_LOG, "shmem_malloc failed")


def test_a_heap_too_small_for_the_shared_runtimes_fails_at_start_up_naming_the_variable(fakes, monkeypatch):
    """Mutant ``no-heap-check`` (plan_shmem checks nothing): FAILS (no start-up error; the fake aiter's
    constructor would fail part-way at the first forward, after allocating)."""
    need = fake_v2_heap_bytes(fakes)
    monkeypatch.setenv("MORI_SHMEM_HEAP_SIZE", str(need // 2))
    with pytest.raises(KnobError, match=rf"MORI_SHMEM_HEAP_SIZE={need // 2} is smaller than .* set MORI_SHMEM_HEAP_SIZE=\d+M"):
        fused(fakes, make_plan(ep=1), rocm_facts("gfx950"))
    assert not calls(fakes.aiter.CALL_LOG, "MegaMoEV2")  # refused before anything was built


def test_without_mori_shmem_heap_size_the_check_assumes_the_2_gib_vllm_names(fakes, monkeypatch):
    """vLLM 0.34: "the MoRI symmetric heap, which defaults to 2 GB. MegaMoEV2 requires > 4GB"
    (all2all.py:951-955), and it sets 8G / 16G itself only for its own aiter_mega_moe (962-966); mori
    624002c8 says 4 GiB (internal.hpp:61). An installed mori's compiled default cannot be read, so the
    smaller one is assumed: V4 Pro at EP 8 with MTPR 4096 (the 128 and 4096 runtimes, 2.25 GiB) is
    refused naming the figure to set. Mutant ``heap-default-4g``: FAILS (accepted, then the first
    forward fails on a 2 GiB mori)."""
    need = sum(v2_shmem_bytes(8, 7168, 48, 6, m, f) for m, f in ((128, True), (4096, False)))
    assert 2 * GIB < need < 4 * GIB and heap_to_set(need) == "3G"
    with pytest.raises(KnobError, match=r"MORI_SHMEM_HEAP_SIZE unset \(assumed 2 GiB.* set MORI_SHMEM_HEAP_SIZE=3G"):
        MoriHeap.from_env({}).check(need, "V4 Pro at EP 8")
    MoriHeap.from_env({"MORI_SHMEM_HEAP_SIZE": "3G"}).check(need, "V4 Pro at EP 8")


@pytest.mark.parametrize("mtpr, fixed, gib", [(128, False, 0.10), (1024, False, 0.60), (4096, False, 2.33),
                                              (128, True, 0.36)])
def test_v2_heap_formula_matches_the_fakes_allocation_list(fakes, mtpr, fixed, gib):
    """The start-up formula (heap.py) against the fake's buffer-by-buffer allocations (both restate
    e4048607's intranode op 657-697, group-major op 435-505 and mega_moe_v2.py:129-136; the fake
    allocates through mori's 256-byte aligned heap, memory.cpp:37). A transcription check of one
    reading, not an upstream fact: it catches the two drifting apart. R1 shapes (32 experts per rank,
    compact) and V4 Pro's fixed-slot decode runtime. Mutant ``heap-drops-group-major`` (the formula
    without the group-major receive buffer): FAILS."""
    epr, topk, inter, experts = (48, 6, 3072, 384) if fixed else (32, 8, 2048, 256)
    need = v2_shmem_bytes(8, 7168, epr, topk, mtpr, fixed)
    got = fake_v2_heap_bytes(fakes, world=8, hidden=7168, experts=experts, topk=topk, mtpr=mtpr, inter=inter)
    assert need - 256 < got <= need and round(need / GIB, 2) == gib


def test_heap_size_values_mori_reads_differently_are_refused():
    """ParseSizeString (mori init.cpp:96-150) drops an unknown tail ("8gB" -> 8 bytes). Mutant
    ``heap-parse-lenient`` (int(float(...)) parsing): FAILS."""
    assert MoriHeap.from_env({"MORI_SHMEM_HEAP_SIZE": "40G"}).capacity == 40 * GIB
    assert MoriHeap.from_env({"MORI_SHMEM_HEAP_SIZE": "512MiB"}).capacity == 512 << 20
    assert MoriHeap.from_env({"MORI_SHMEM_MODE": "isolation"}).capacity is None
    for raw in ("6.5G", "8gB", "8G ", "lots"):
        with pytest.raises(KnobError, match="MORI_SHMEM_HEAP_SIZE="):
            MoriHeap.from_env({"MORI_SHMEM_HEAP_SIZE": raw})


# ---- gfx1250 (e4048607) ----------------------------------------------------------------------------------------------

def test_gfx1250_a4w4_runs_fused_on_weights_viewed_as_fp4x2(fakes, monkeypatch):
    """aiter's grouped gfx1250 kernel takes fp4 activations (A4W4) only for ``w1.dtype == fp4x2``
    (grouped_moe_gfx1250.py:991; fused_moe takes the weight format from ``w1``, fused_moe.py:758); on
    uint8 fused_moe's generic path runs and the fused combine returns a buffer nothing wrote. The
    adapter views the shuffled weights as fp4x2, so A4W4 (AITER_FORCE_A8W4 unset, ATOM's ``wire=fp4
    force_a8w4=0``) runs fused and right. On the old code (uint8 weights; selection refused A4W4 as
    ``gfx1250_fused_refusal``) this test FAILS (selection is unfused, and the uint8 weights give zeros)."""
    on_arch(fakes, monkeypatch, "gfx1250")
    monkeypatch.delenv("AITER_FORCE_A8W4")
    plan = make_plan(wire="fp4", quant="a4w4", ep=1)
    sel = select(plan, rocm_facts("gfx1250"))
    assert (sel.fused, sel.runtime, sel.a_operand, sel.dispatch_wire) == (True, "MegaMoEGfx1250", "fp4", "fp4")
    m = fused(fakes, plan, rocm_facts("gfx1250"))
    w = layer_weights(0, ep=1)
    lw = m.prepare_weights(w)
    assert lw.w1.dtype == lw.w2.dtype == torch.float4_e2m1fn_x2
    x, ids, tw = inputs()
    assert rel_l2(m(x, ids, tw, lw).float(), reference(w, x, ids, tw)) < 1e-2
    mod = fakes.aiter.ops.flydsl.kernels.mega_moe_gfx1250  # the fake does what aiter does on uint8 weights:
    rt = mod.MegaMoEGfx1250(communicator=object(), rank=0, world_size=1, model_dim=H, inter_dim=I, experts=E,
                            topk=K, max_tokens_per_rank=8)
    as_uint8 = dict(w1=lw.w1.view(torch.uint8), w2=lw.w2.view(torch.uint8), w1_scale=lw.w1_scale, w2_scale=lw.w2_scale)
    assert not rt.forward(x.to(torch.bfloat16), tw, ids.to(torch.int32), **as_uint8).any()  # stale zeros


@pytest.mark.parametrize("arch", ["gfx950", "gfx1250"])
def test_a_forward_result_survives_the_next_forward_of_the_shared_runtime(fakes, monkeypatch, arch):
    """The result is a view of the runtime's combine buffer (mega_moe_v2.py:271-278, mega_moe_gfx1250/
    mega_moe.py:745-750), rewritten by its next forward -- the next layer's, the runtime being shared.
    Mutant ``result-not-copied`` (the view returned): FAILS (the kept result changes)."""
    on_arch(fakes, monkeypatch, arch)
    facts = rocm_facts(arch, force_a8w4="1")
    layers = [fused(fakes, make_plan(ep=1, force=True), facts, layer_id=i) for i in range(2)]
    raw = [layer_weights(i, ep=1) for i in range(2)]
    weights = [m.prepare_weights(w) for m, w in zip(layers, raw)]
    x, ids, tw = inputs()
    kept = layers[0](x, ids, tw, weights[0])
    snapshot = kept.clone()
    layers[1](x, ids, tw, weights[1])
    layers[0](*inputs(seed=8), weights[0])
    assert torch.equal(kept, snapshot)
    assert rel_l2(kept.float(), reference(raw[0], x, ids, tw)) < 1e-2
    out = torch.empty(5, H, dtype=torch.bfloat16)  # the caller's buffer, written in place
    assert layers[1](x, ids, tw, weights[1], out=out) is out
    assert rel_l2(out.float(), reference(raw[1], x, ids, tw)) < 1e-2


def test_gfx1250_shapes_the_scale_shuffle_cannot_take_fail_at_start_up_naming_the_checkpoint(fakes, monkeypatch):
    """aiter's gfx1250 scale shuffle needs K // 32 % 4 == 0 (aiter/ops/shuffle.py:283-288). Mutant
    ``no-gfx1250-shape-check``: FAILS (no start-up error; the shuffle's bare ValueError would come while
    loading weights)."""
    on_arch(fakes, monkeypatch, "gfx1250")
    plan = make_plan(force=True, hidden=96)
    with pytest.raises(KnobError, match="hidden_size=96 cannot run aiter MegaMoEGfx1250"):
        fused(fakes, plan, rocm_facts("gfx1250", force_a8w4="1"))
    with pytest.raises(ValueError, match=r"K//32 must be divisible by 4"):  # what the fake (and aiter) would say
        fakes.aiter.ops.shuffle.moe_shuffle_scale(torch.zeros(4, 256, 3, dtype=torch.uint8), experts_cnt=4)


def test_a_runtime_built_inside_inference_mode_runs_outside_it(fakes, monkeypatch):
    """MegaMoEGfx1250's mori dispatch zeroes ``_total_recv`` in place each forward (mega_moe.py:628);
    ATOM and SGLang build and run the runtime under inference_mode(False). Mutant
    ``no-normal-tensors`` (normal_tensors() a no-op): FAILS (inplace update to an inference tensor)."""
    on_arch(fakes, monkeypatch, "gfx1250")
    m = fused(fakes, make_plan(wire="fp8", ep=1, force=True), rocm_facts("gfx1250", force_a8w4="1"))
    w = layer_weights(0, ep=1)
    lw = m.prepare_weights(w)
    x, ids, tw = inputs()
    with torch.inference_mode():
        m(x, ids, tw, lw)
    with torch.no_grad():
        out = m(x, ids, tw, lw)
    out.mul_(1.0)  # the engine may scale it in place
    assert rel_l2(out.float(), reference(w, x, ids, tw)) < 1e-2


# ---- mori shmem bootstrap (mori python/mori/shmem/api.py:113-119, src/shmem/init.cpp:669-674) -----------------------

def test_shmem_bootstrap_is_rooted_at_the_groups_first_rank(fakes):
    """mori's shmem_torch_process_group_init broadcasts the id from global rank 0, which an EP group of
    global ranks 4..7 does not contain. Mutant ``bootstrap-from-global-0`` (src=0): FAILS (ValueError)."""
    group = FakeGroup((4, 5, 6, 7))
    dist = FakeDist(rank=0, log=fakes.mori.CALL_LOG)
    fakes.mori.shmem.api.DIST = dist
    assert init_mori_shmem(group, 0, 4, shmem=fakes.mori.shmem, dist=dist) == "initialised"
    (bcast,) = calls(fakes.mori.CALL_LOG, "broadcast_object_list")
    assert bcast[2] == 4 and (fakes.mori.shmem.shmem_mype(), fakes.mori.shmem.shmem_npes()) == (0, 4)


def _engine_starts_shmem(fakes, group, rank=0):
    """What vLLM's MoriAll2AllManager does: register its group as "mori", then mori's own init."""
    fakes.mori.shmem.api.DIST = FakeDist(rank=rank)
    fakes.mori.fake_register_process_group("mori", group)
    fakes.mori.shmem.shmem_torch_process_group_init("mori")
    fakes.mori.CALL_LOG.clear()


def test_shmem_the_engine_started_on_the_same_ranks_is_reused(fakes):
    """mori skips a second init silently (init.cpp:669-674). Mutant ``always-init-shmem`` (no reuse
    check): FAILS (a second id minted and broadcast)."""
    group = FakeGroup((0, 1))
    _engine_starts_shmem(fakes, group)
    assert init_mori_shmem(group, 0, 2, shmem=fakes.mori.shmem, dist=FakeDist(log=fakes.mori.CALL_LOG)) == "reused"
    assert fakes.mori.CALL_LOG == []  # no id minted, nothing broadcast, no second init


def test_shmem_the_engine_started_on_another_group_is_an_error(fakes):
    """Mutant ``no-world-check`` (mype / npes not compared): FAILS (MegaMoE would run on the engine's
    8-rank shmem world)."""
    _engine_starts_shmem(fakes, FakeGroup(tuple(range(8))))
    with pytest.raises(TransportError, match="runs on 8 PEs .* EP group has 2 ranks"):
        init_mori_shmem(FakeGroup((0, 1)), 0, 2, shmem=fakes.mori.shmem, dist=FakeDist())
