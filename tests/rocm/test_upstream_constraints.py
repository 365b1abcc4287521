"""Upstream constraints the fakes copy (ROCm/aiter e4048607, ROCm/mori 624002c8), each with the test
that the adapter honours it. Every test here failed on the adapter before issue 34 (the docstring
says how); the mori-transport ones (InterNodeV1 blockwise combine, gfx1250 A4W4 unfused) live in
test_mori_transport.py next to the transport helpers."""

from __future__ import annotations

import pytest
import torch
from aiter_helpers import E, H, I, K, calls, fused, inputs, layer_weights, make_plan, on_arch, reference
from rocm_helpers import FakeDist, FakeGroup, knobs, rocm_facts

from megamoe_backend.experts.aiter import MoriHeap, cached_runtime_keys, prepare_gfx1250_weights, v2_shmem_bytes
from megamoe_backend.experts.base import ExpertMath
from megamoe_backend.knobs import KnobError
from megamoe_backend.layer.reference import rel_l2
from megamoe_backend.platform import select_backends
from megamoe_backend.transport import TransportError
from megamoe_backend.transport.mori import init_mori_shmem

GIB = 1 << 30


def fake_v2_heap_bytes(fakes, world=1, hidden=H, experts=E, topk=K, mtpr=512) -> int:
    """Bytes the fake MegaMoEV2 takes from a fresh fake heap, allocation by allocation as upstream."""
    shmem = fakes.mori.shmem
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, world, shmem.shmem_get_unique_id())
    before = shmem.heap_used()
    w = torch.zeros(1, dtype=torch.uint8)  # the constructor only stores weights
    fakes.aiter.ops.flydsl.kernels.mega_moe.MegaMoEV2(
        rank=0, world_size=world, model_dim=hidden, inter_dim=I, experts=experts, topk=topk, quant="a8w4",
        w1=w, w1_scale=w, w2=w, w2_scale=w, max_tok_per_rank=mtpr)
    used = shmem.heap_used() - before
    shmem.shmem_finalize()
    fakes.mori.CALL_LOG.clear()
    fakes.aiter.CALL_LOG.clear()
    return used


# ---- mori's symmetric heap (mori tensor_utils.py:50, init.cpp:223-227, memory.cpp:37) -----------------

def test_layers_share_one_v2_runtime_inside_a_heap_one_per_layer_would_exhaust(fakes, monkeypatch):
    """Before: one MegaMoEV2 per layer; the second layer's first forward hit `AssertionError:
    mori_shmem.shmem_malloc failed` in the fake heap, as on a gfx950 with 60 layers."""
    monkeypatch.setenv("MORI_SHMEM_HEAP_SIZE", str(fake_v2_heap_bytes(fakes) * 3 // 2))
    facts = rocm_facts("gfx950")
    layers = [fused(fakes, make_plan(ep=1), facts, layer_id=i) for i in range(3)]
    raw = [layer_weights(i, ep=1) for i in range(3)]
    x, ids, tw = inputs()
    for m, w in zip(layers, raw):
        assert rel_l2(m(x, ids, tw, m.prepare_weights(w)).float(), reference(w, x, ids, tw)) < 1e-2
    assert len(cached_runtime_keys()) == 1 and not calls(fakes.mori.CALL_LOG, "shmem_malloc failed")


def test_a_heap_too_small_for_the_shared_runtime_fails_at_start_up_naming_the_variable(fakes, monkeypatch):
    """Before: nothing was checked; the first forward failed part-way inside aiter's constructor."""
    need = fake_v2_heap_bytes(fakes)
    monkeypatch.setenv("MORI_SHMEM_HEAP_SIZE", str(need // 2))
    with pytest.raises(KnobError, match=rf"MORI_SHMEM_HEAP_SIZE={need // 2} is smaller than .* set MORI_SHMEM_HEAP_SIZE=\d+M"):
        fused(fakes, make_plan(ep=1), rocm_facts("gfx950"))
    assert not calls(fakes.aiter.CALL_LOG, "MegaMoEV2")  # refused before anything was built


@pytest.mark.parametrize("mtpr, gib", [(128, 0.24), (1024, 0.60), (4096, 2.33)])
def test_v2_heap_size_matches_the_fakes_allocations_at_deepseek_shapes(fakes, mtpr, gib):
    """DeepSeek V4 / R1 at EP 8 (hidden 7168, 256 experts, top-8): the formula the start-up check uses
    against the fake's upstream-shaped allocation list, and against the default 4 GiB heap."""
    need = v2_shmem_bytes(8, 7168, 32, 8, mtpr)
    assert need - 256 < fake_v2_heap_bytes(fakes, world=8, hidden=7168, experts=256, topk=8, mtpr=mtpr) <= need
    assert round(need / GIB, 2) == gib
    MoriHeap.from_env({}).check(need, "one shared runtime")  # fits mori's default heap ...
    with pytest.raises(KnobError, match="MORI_SHMEM_HEAP_SIZE unset"):
        MoriHeap.from_env({}).check(61 * need, "one runtime per layer")  # ... one per layer never does


def test_heap_size_values_mori_reads_differently_are_refused():
    assert MoriHeap.from_env({"MORI_SHMEM_HEAP_SIZE": "40G"}).capacity == 40 * GIB
    assert MoriHeap.from_env({"MORI_SHMEM_HEAP_SIZE": "512MiB"}).capacity == 512 << 20
    assert MoriHeap.from_env({"MORI_SHMEM_MODE": "isolation"}).capacity is None
    for raw in ("6.5G", "8gB", "8G ", "lots"):
        with pytest.raises(KnobError, match="MORI_SHMEM_HEAP_SIZE="):
            MoriHeap.from_env({"MORI_SHMEM_HEAP_SIZE": raw})


# ---- an idle rank (mega_moe_config.py:91-92) ------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gfx950", "gfx1250"])
def test_an_idle_rank_sends_one_zero_weight_token_and_returns_no_rows(fakes, monkeypatch, arch):
    """Before: T = 0 reached MegaMoEV2, whose config selector raises "tokens must be positive" on that
    rank while its peers wait in the collective kernel."""
    on_arch(fakes, monkeypatch, arch)
    m = fused(fakes, make_plan(force=True), rocm_facts(arch, force_a8w4="1"))
    lw = m.prepare_weights(layer_weights(0))
    x, ids, tw = inputs()
    out = m(x[:0], ids[:0], tw[:0], lw)
    assert out.shape == (0, H) and out.dtype == torch.bfloat16
    call = m.runtime(None).forward_calls[-1]
    x_sent, w_sent = call["x"], call["wts"]
    assert x_sent.shape == (1, H) and not x_sent.any() and w_sent.shape == (1, K) and not w_sent.any()
    assert m(x, ids, tw, lw).shape == (5, H)  # and the next step is an ordinary one


# ---- MegaMoEV2 runs intranode only (flydsl_dispatch_combine_intranode_op.py:37, 749-754) -----------------

def test_gfx950_ep_above_8_is_not_fused_and_says_why(fakes):
    """Before: selected fused, and the first forward failed in MegaMoEV2's constructor."""
    sel = select_backends(rocm_facts("gfx950"), knobs(dispatch_wire="fp8", max_tokens_per_rank=512),
                          ExpertMath("a8w4"), ep_size=16, num_experts=256)
    assert (sel.fused, sel.transport) == (False, "mori")
    assert any("world_size <= 8; EP size is 16" in r for r in sel.reasons)
    shmem = fakes.mori.shmem
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 16, shmem.shmem_get_unique_id())
    w = torch.zeros(1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="exceeds intranode limit"):  # the fake refuses as aiter does
        fakes.aiter.ops.flydsl.kernels.mega_moe.MegaMoEV2(
            rank=0, world_size=16, model_dim=H, inter_dim=I, experts=256, topk=K, quant="a8w4",
            w1=w, w1_scale=w, w2=w, w2_scale=w, max_tok_per_rank=512)


# ---- gfx1250 A4W4: the grouped kernel wants fp4x2 weights (grouped_moe_gfx1250.py:991) ------------------

def test_gfx1250_fused_a4w4_on_uint8_weights_would_return_a_stale_combine_buffer(fakes, monkeypatch):
    """What the fake does (as aiter does) when the fused runtime runs fp4 activations on the uint8 weights
    the shuffles produce: the combine returns a buffer nothing wrote. Selection therefore refuses it
    (test_select.py, test_mori_transport.py); before, it selected exactly this."""
    fakes.aiter.reset("gfx1250")
    mod = fakes.aiter.ops.flydsl.kernels.mega_moe_gfx1250
    rt = mod.MegaMoEGfx1250(communicator=object(), rank=0, world_size=1, model_dim=H, inter_dim=I, experts=E,
                            topk=K, max_tokens_per_rank=8)
    w = layer_weights(0, ep=1)
    lw = prepare_gfx1250_weights(w, fakes.aiter.ops.shuffle)  # uint8, as aiter's shuffles return them
    x, ids, tw = inputs()
    args = (x.to(torch.bfloat16), tw, ids.to(torch.int32))
    shuffled = dict(w1=lw.w1, w2=lw.w2, w1_scale=lw.w1_scale, w2_scale=lw.w2_scale)
    assert not rt.forward(*args, **shuffled).any()  # AITER_FORCE_A8W4 unset: fp4 A, uint8 W -> stale zeros
    monkeypatch.setenv("AITER_FORCE_A8W4", "1")
    fresh = rt.forward(*args, **shuffled)
    assert rel_l2(fresh.float(), reference(w, x, ids, tw)) < 1e-2


# ---- the result is a view the runtime rewrites (mega_moe_v2.py:271-278, mega_moe_gfx1250/mega_moe.py:745-750)

@pytest.mark.parametrize("arch", ["gfx950", "gfx1250"])
def test_a_forward_result_survives_the_next_forward_of_the_shared_runtime(fakes, monkeypatch, arch):
    """Before: the result was the runtime's buffer; the next forward (the next layer's, the runtime
    being shared on gfx1250; the same layer's next step on gfx950) rewrote what the engine held."""
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


# ---- MegaMoEGfx1250's scale shuffle shapes (aiter/ops/shuffle.py:283-288) -------------------------------

def test_gfx1250_shapes_the_scale_shuffle_cannot_take_fail_at_start_up_naming_the_checkpoint(fakes):
    """Before: accepted; aiter's moe_shuffle_scale raised a bare ValueError while loading weights."""
    fakes.aiter.reset("gfx1250")
    plan = make_plan(force=True, hidden=96)
    with pytest.raises(KnobError, match="hidden_size=96 cannot run aiter MegaMoEGfx1250"):
        fused(fakes, plan, rocm_facts("gfx1250", force_a8w4="1"))
    with pytest.raises(ValueError, match=r"K//32 must be divisible by 4"):  # what the fake (and aiter) would say
        fakes.aiter.ops.shuffle.moe_shuffle_scale(torch.zeros(4, 256, 3, dtype=torch.uint8), experts_cnt=4)


# ---- built in one torch mode, run in another (mega_moe_gfx1250/mega_moe.py:628) -------------------------

def test_a_runtime_built_inside_inference_mode_runs_outside_it(fakes, monkeypatch):
    """Before: built lazily in the engine's first (inference-mode) forward, its buffers were inference
    tensors and the mori dispatch's `_total_recv.zero_()` failed in a later forward outside it.
    Upstream (ATOM, SGLang) builds and runs the runtime under inference_mode(False) for this."""
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


# ---- mori shmem bootstrap (mori python/mori/shmem/api.py:113-119, src/shmem/init.cpp:669-674) -----------

def test_shmem_bootstrap_is_rooted_at_the_groups_first_rank(fakes):
    """Before: mori's shmem_torch_process_group_init broadcast the id from global rank 0, which an EP
    group of global ranks 4..7 does not contain: torch raised ValueError."""
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
    """Before: a second registration and init; mori skips it silently, so it only looked fine."""
    group = FakeGroup((0, 1))
    _engine_starts_shmem(fakes, group)
    assert init_mori_shmem(group, 0, 2, shmem=fakes.mori.shmem, dist=FakeDist(log=fakes.mori.CALL_LOG)) == "reused"
    assert fakes.mori.CALL_LOG == []  # no id minted, nothing broadcast, no second init


def test_shmem_the_engine_started_on_another_group_is_an_error(fakes):
    """Before: mori skipped our init silently and MegaMoE ran on the engine's 8-rank shmem world."""
    _engine_starts_shmem(fakes, FakeGroup(tuple(range(8))))
    with pytest.raises(TransportError, match="runs on 8 PEs .* EP group has 2 ranks"):
        init_mori_shmem(FakeGroup((0, 1)), 0, 2, shmem=fakes.mori.shmem, dist=FakeDist())
