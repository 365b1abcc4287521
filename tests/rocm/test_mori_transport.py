"""mori transport contract: what MegaMoE hands to mori (config fields, dtypes, shapes, scale_dim,
quant_type, kernel_type, shmem init order) and, through the fake fabric, that a MegaMoELayer over
mori gives the same answer as the single-process layer."""

from __future__ import annotations

import logging

import pytest
import torch
from rocm_helpers import FakeDist, FakeGroup, rocm_facts, run_ranks
from rocm_helpers import knobs as selection_knobs

from megamoe_backend.experts import quantize_expert_weights
from megamoe_backend.experts.base import ExpertMath
from megamoe_backend.experts.weights import ExpertWeights
from megamoe_backend.knobs import KnobError, Knobs
from megamoe_backend.layer.megamoe_layer import MegaMoELayer
from megamoe_backend.layer.reference import rel_l2
from megamoe_backend.plan import build_plan
from megamoe_backend.platform import select_backends
from megamoe_backend.platform.topology import EpTopology, RankPlace
from megamoe_backend.spec import MoESpec
from megamoe_backend.transport import PeerInputError, TransportError
from megamoe_backend.transport.layout import DispatchLayout
from megamoe_backend.transport.mori import (
    COMBINE_SCALE_DIM_ENV,
    MoriTransport,
    MoriWire,
    apply_combine_scale_env,
    init_mori_shmem,
    local_slots,
    mori_routing,
    pick_kernel_type,
)

H, I, E, K = 64, 32, 8, 2
GROUP = FakeGroup((0, 1))  # stands in for the EP process group


def make_plan(rank=0, ep=2, wire="bf16", combine="bf16", quant="a8w4", mtpr=16, experts=E):
    spec = MoESpec(hidden_size=H, moe_intermediate_size=I, n_routed_experts=experts, num_experts_per_tok=K, quant=quant)
    knobs = Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=mtpr)
    return build_plan(spec, knobs, ep_rank=rank, ep_size=ep, backends=("torch", "mori"))


def make_transport(fakes, plan, group=None, **kw):
    kw.setdefault("gpus_per_node", 8)
    kw.setdefault("dist", FakeDist(rank=plan.ep_rank, log=fakes.mori.CALL_LOG))
    kw.setdefault("all_reduce_max", lambda s: s)
    group = group or (GROUP if plan.ep_size == 2 else FakeGroup(tuple(range(plan.ep_size))))
    return MoriTransport(plan, group, torch.device("cpu"), **kw)


# ---- pure mapping of the wire knobs --------------------------------------------------------

@pytest.mark.parametrize(
    "wire, dtype, cols, scale_dim",
    [("bf16", torch.bfloat16, 7168, 0), ("fp8", torch.float8_e4m3fn, 7168, 224), ("fp4", torch.float4_e2m1fn_x2, 3584, 224)],
)
def test_wire_sets_payload_dtype_and_scale_dim(wire, dtype, cols, scale_dim):
    w = MoriWire.from_knobs(wire, "bf16", 7168)
    assert (w.data_type, w.payload_cols, w.scale_dim, w.scale_type_size) == (dtype, cols, scale_dim, 1)
    assert (w.max_token_type_size, w.config_hidden_dim, w.quant_type) == (2, 7168, "none")
    assert w.row_bytes == {"bf16": 14336, "fp8": 7168 + 224, "fp4": 3584 + 224}[wire]


def test_fp8_blockwise_combine_maps_to_moris_quant_type_with_1x32_blocks():
    w = MoriWire.from_knobs("bf16", "fp8_blockwise_1x32", 7168)
    assert (w.quant_type, w.combine_scale_dim) == ("fp8_blockwise", 224)
    env = {}
    apply_combine_scale_env(w, env)
    assert env == {COMBINE_SCALE_DIM_ENV: "224"}


def test_combine_scale_env_already_set_differently_is_an_error():
    w = MoriWire.from_knobs("bf16", "fp8_blockwise_1x32", 7168)
    with pytest.raises(KnobError, match="MORI_FP8_COMBINE_SCALE_DIM=224"):
        apply_combine_scale_env(w, {COMBINE_SCALE_DIM_ENV: "56"})


def test_blockwise_combine_with_quantised_dispatch_is_refused():
    with pytest.raises(KnobError, match="bf16 dispatch and combine dtypes"):
        MoriWire.from_knobs("fp4", "fp8_blockwise_1x32", 7168)


def test_quantised_wire_needs_whole_1x32_blocks():
    with pytest.raises(KnobError, match="multiple of 32"):
        MoriWire.from_knobs("fp8", "bf16", 100)


def test_kernel_type_and_gpu_per_node():
    assert pick_kernel_type(8, 8) == ("IntraNode", 8)
    assert pick_kernel_type(4, 8) == ("IntraNode", 4)
    assert pick_kernel_type(16, 8) == ("InterNodeV1", 8)
    with pytest.raises(TransportError, match="power-of-two"):
        pick_kernel_type(12, 6)
    with pytest.raises(TransportError, match="not a multiple"):
        pick_kernel_type(12, 8)


# ---- shmem initialisation -----------------------------------------------------------------

def test_shmem_init_broadcasts_the_id_then_initialises_once(fakes):
    log = fakes.mori.CALL_LOG
    dist = FakeDist(rank=0, log=log)
    assert init_mori_shmem(GROUP, 0, 2, shmem=fakes.mori.shmem, dist=dist) == "initialised"
    assert init_mori_shmem(GROUP, 0, 2, shmem=fakes.mori.shmem, dist=dist) == "initialised"
    assert [c[0] for c in log] == ["shmem_get_unique_id", "broadcast_object_list", "shmem_init_attr"]
    assert log[1][1:] == ("bytes", 0, GROUP) and log[2][1:] == (fakes.mori.shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 2)
    assert (fakes.mori.shmem.shmem_mype(), fakes.mori.shmem.shmem_npes()) == (0, 2)


def test_shmem_init_on_a_non_root_rank_receives_the_id(fakes):
    log = fakes.mori.CALL_LOG
    init_mori_shmem(GROUP, 1, 2, shmem=fakes.mori.shmem, dist=FakeDist(rank=1, log=log))
    assert [c[0] for c in log] == ["broadcast_object_list", "shmem_init_attr"]  # only the root mints an id
    assert log[0][1] == "NoneType" and log[1][2:] == (1, 2)


def test_shmem_init_on_a_second_group_is_an_error(fakes):
    init_mori_shmem(GROUP, 0, 2, shmem=fakes.mori.shmem, dist=FakeDist())
    with pytest.raises(TransportError, match="another process group"):
        init_mori_shmem(FakeGroup((0, 1)), 0, 2, shmem=fakes.mori.shmem, dist=FakeDist())


# ---- the config and the calls mori receives -----------------------------------------------

def test_transport_builds_moris_config_field_by_field(fakes, caplog):
    with caplog.at_level(logging.INFO, logger="megamoe"):
        t = make_transport(fakes, make_plan(rank=1, ep=2, wire="fp8", mtpr=16))
    cfg = t.config
    assert type(cfg) is fakes.mori.ops.EpDispatchCombineConfig
    assert (cfg.data_type, cfg.rank, cfg.world_size, cfg.hidden_dim) == (torch.float8_e4m3fn, 1, 2, H)
    assert (cfg.scale_dim, cfg.scale_type_size, cfg.max_token_type_size) == (H // 32, 1, 2)
    assert (cfg.max_num_inp_token_per_rank, cfg.num_experts_per_rank, cfg.num_experts_per_token) == (16, 4, K)
    assert (cfg.kernel_type, cfg.gpu_per_node, cfg.quant_type) == (fakes.mori.ops.EpDispatchCombineKernelType.IntraNode, 2, "none")
    order = [c[0] for c in fakes.mori.CALL_LOG]
    assert order == ["broadcast_object_list", "shmem_init_attr", "EpDispatchCombineOp"]  # rank 1: no id minted
    assert "dispatch=mori" in caplog.text and "wire=fp8" in caplog.text


def test_fp8_combine_sets_moris_env_before_the_op_reads_it(fakes, monkeypatch):
    monkeypatch.delenv(COMBINE_SCALE_DIM_ENV, raising=False)
    t = make_transport(fakes, make_plan(ep=1, combine="fp8_blockwise_1x32"))
    assert t.config.quant_type == "fp8_blockwise" and t.op.combine_scale_dim == H // 32


def test_unequal_expert_counts_are_refused(fakes):
    from megamoe_backend.plan.placement import ExpertPlacement

    spec = MoESpec(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K, quant="a8w4")
    placement = ExpertPlacement.from_assignment([0, 0, 0, 0, 0, 1, 1, 1], 2)
    plan = build_plan(spec, Knobs(), 0, 2, placement=placement, backends=("torch", "mori"))
    with pytest.raises(KnobError, match="same expert count on every rank"):
        make_transport(fakes, plan)


def test_dispatch_passes_int32_ids_fp32_weights_and_split_scales(fakes):
    plan = make_plan(ep=1, wire="fp4", quant="a4w4")
    t = make_transport(fakes, plan)
    x = torch.randn(5, H)
    rows = plan.dispatch.encode(x)
    ids = torch.tensor([[0, 3], [7, 1], [2, 2], [5, -1], [4, 6]])
    owner, slot = plan.placement.tables()
    layout = DispatchLayout.build(ids, torch.rand(5, K), owner, slot, 1)
    res = t.dispatch(rows, layout)
    call = t.op.calls[0][1]
    assert call["input"].dtype == torch.float4_e2m1fn_x2 and tuple(call["input"].shape) == (5, H // 2)
    assert call["scales"].dtype == torch.uint8 and tuple(call["scales"].shape) == (5, H // 32)
    assert call["indices"].dtype == torch.int32 and call["weights"].dtype == torch.float32
    assert torch.equal(res.rows, rows)  # received rows are the sent wire rows, payload then scales
    assert res.slots[3].tolist() == [5, -1] and res.weights[3, 1] == 0  # masked entry: copy of id 5, dropped


def test_more_tokens_than_mtpr_is_refused_before_mori(fakes):
    plan = make_plan(ep=1, mtpr=4)
    t = make_transport(fakes, plan)
    owner, slot = plan.placement.tables()
    layout = DispatchLayout.build(torch.zeros(5, K, dtype=torch.long), torch.ones(5, K), owner, slot, 1)
    with pytest.raises(PeerInputError, match="MEGA_MAX_TOKENS_PER_RANK=4"):
        t.dispatch(plan.dispatch.encode(torch.zeros(5, H)), layout)
    assert t.op.calls == []


def test_bad_input_on_a_peer_fails_every_rank(fakes):
    plan = make_plan(ep=1)
    t = make_transport(fakes, plan, all_reduce_max=lambda s: 2)  # a peer reported status 2
    owner, slot = plan.placement.tables()
    layout = DispatchLayout.build(torch.zeros(1, K, dtype=torch.long), torch.ones(1, K), owner, slot, 1)
    with pytest.raises(PeerInputError, match="one rank reported bad input"):
        t.dispatch(plan.dispatch.encode(torch.zeros(1, H)), layout)


def test_a_peer_with_another_token_bound_fails_every_rank(fakes):
    """The bound travels in mori's status reduction: (max, -max of -b) differ -> every rank refuses."""
    plan = make_plan(ep=1)
    peer = {0: 0, 4: 8, -4: -8}  # what the peer contributes: status 0, bound 8
    t = make_transport(fakes, plan, all_reduce_max=lambda v: max(v, peer[v]))
    owner, slot = plan.placement.tables()
    layout = DispatchLayout.build(torch.zeros(1, K, dtype=torch.long), torch.ones(1, K), owner, slot, 1)
    with pytest.raises(PeerInputError, match=r"different max_tokens_across_ranks .*\(lowest: 4, highest: 8\)"):
        t.dispatch(plan.dispatch.encode(torch.zeros(1, H)), layout, bound=4)
    assert t.op.calls == []


def test_routing_helpers_round_trip():
    owner = torch.tensor([0, 0, 1, 1]); slot = torch.tensor([0, 1, 0, 1])
    layout = DispatchLayout.build(torch.tensor([[3, 0], [-1, -1]]), torch.tensor([[0.25, 0.75], [0.5, 0.5]]), owner, slot, 2)
    ids, w = mori_routing(layout, 2)
    assert ids.tolist() == [[3, 0], [0, 0]] and w.tolist() == [[0.25, 0.75], [0.0, 0.0]]
    slots, weights = local_slots(ids, w, rank=1, experts_per_rank=2)
    assert slots.tolist() == [[1, -1], [-1, -1]] and weights[0].tolist() == [0.25, 0.0]
    # a masked k = 0 is sent as a copy (weight 0) of the token's first valid id, which stands later: the
    # expert runs once, with the real weight (mutant ``local-slots-first-weight``: FAILS, weight 0)
    layout = DispatchLayout.build(torch.tensor([[-1, 2, 3]]), torch.tensor([[0.9, 0.3, 0.7]]), owner, slot, 2)
    ids, w = mori_routing(layout, 2)
    assert ids.tolist() == [[2, 2, 3]] and w.tolist() == [[0.0, 0.30000001192092896, 0.699999988079071]]
    slots, weights = local_slots(ids, w, rank=1, experts_per_rank=2)
    assert slots.tolist() == [[0, -1, 1]] and torch.allclose(weights, torch.tensor([[0.3, 0.0, 0.7]]))


# ---- numerics through the fake fabric (threads = ranks) -----------------------------------

def _weights(quant, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
    return quantize_expert_weights(w1, w2, "mxfp4" if quant != "bf16" else "bf16")


def _local(w: ExpertWeights, lo, hi) -> ExpertWeights:
    s = lambda t: None if t is None else t[lo:hi].contiguous()  # noqa: E731
    return ExpertWeights(s(w.w1), s(w.w2), w.fmt, w.gate_up_layout, s(w.w1_scale), s(w.w2_scale))


@pytest.mark.parametrize("wire, quant", [("bf16", "a8w4"), ("fp8", "a8w4"), ("fp4", "a4w4")])
def test_layer_over_mori_matches_the_single_process_layer(fakes, wire, quant):
    ep, t_per_rank = 2, 6
    weights = _weights(quant)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(t_per_rank, H, generator=g).to(torch.bfloat16) for _ in range(ep)]
    ids = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t_per_rank)]) for _ in range(ep)]
    ids[1][2, 1] = -1  # one masked entry
    tw = [torch.rand(t_per_rank, K, generator=g) for _ in range(ep)]
    fakes.mori.ops.EpDispatchCombineOp.FABRIC_GENERATION = f"layer-{wire}"

    def rank(r):
        plan = make_plan(rank=r, ep=ep, wire=wire, quant=quant)
        transport = make_transport(fakes, plan)
        layer = MegaMoELayer(plan, _local(weights, r * E // ep, (r + 1) * E // ep), transport=transport)
        return layer(xs[r], ids[r], tw[r])

    got = torch.cat(run_ranks(rank, ep))
    ref_plan = make_plan(rank=0, ep=1, wire=wire, quant=quant)
    want = MegaMoELayer(ref_plan, weights)(torch.cat(xs), torch.cat(ids), torch.cat(tw))
    assert rel_l2(got.float(), want.float()) < 1e-2  # mori sums bf16 partials per rank
    assert torch.isfinite(got).all()


# ---- upstream constraints (see test_upstream_constraints.py) --------------------------------

def test_blockwise_combine_over_nodes_is_refused_at_start_up(fakes):
    """mori's blockwise combine runs on IntraNode / IntraNodeLL / AsyncLL only (ROCm/mori 624002c8
    dispatch_combine.py:1485-1506). Before: the transport was built with InterNodeV1 and the first
    combine raised ValueError in mori; selection could pick that pair."""
    plan = make_plan(ep=2, combine="fp8_blockwise_1x32")
    with pytest.raises(KnobError, match=r"MEGA_COMBINE_WIRE=fp8_blockwise_1x32 .*\(kernel_type InterNodeV1LL\)"):
        make_transport(fakes, plan, gpus_per_node=1)  # 2 nodes of 1 GPU, 16 tokens per rank: InterNodeV1LL
    assert not [c for c in fakes.mori.CALL_LOG if c[0] == "shmem_init_attr"]  # refused before any start-up step
    ops = fakes.mori.ops
    cfg = ops.EpDispatchCombineConfig(data_type=torch.bfloat16, rank=0, world_size=1, hidden_dim=H, scale_dim=0,
                                      scale_type_size=1, max_token_type_size=2, max_num_inp_token_per_rank=4,
                                      num_experts_per_rank=E, num_experts_per_token=K, gpu_per_node=1,
                                      kernel_type=ops.EpDispatchCombineKernelType.InterNodeV1, quant_type="fp8_blockwise")
    op = ops.EpDispatchCombineOp(cfg)
    op.FABRIC_GENERATION = "internode-check"
    ids = torch.zeros(1, K, dtype=torch.int32)
    op.dispatch(torch.zeros(1, H, dtype=torch.bfloat16), torch.ones(1, K), None, ids)
    with pytest.raises(ValueError, match="fp8_blockwise combine currently only supports IntraNode/IntraNodeLL/AsyncLL"):
        op.combine(torch.zeros(1, H, dtype=torch.bfloat16), None, ids)  # what the fake (and mori) would do


def test_selection_keeps_the_blockwise_combine_off_internode_mori():
    """Whether the EP group spans nodes comes from where its ranks run (the gathered topology), not from
    this process's GPU count; without the topology the transport checks its own kernel."""
    import dataclasses

    knobs = selection_knobs
    two_hosts = EpTopology(tuple(RankPlace(f"host{r // 8}") for r in range(16)))
    a8w4, facts = ExpertMath("a8w4"), dataclasses.replace(rocm_facts("gfx942"), ep_topology=two_hosts)
    with pytest.raises(KnobError, match="over 16 EP ranks on 2 host.* use MEGA_COMBINE_WIRE=bf16"):
        select_backends(facts, knobs(combine_wire="fp8_blockwise_1x32", transport="mori"), a8w4, ep_size=16, num_experts=256)
    sel = select_backends(facts, knobs(combine_wire="fp8_blockwise_1x32"), a8w4, ep_size=16, num_experts=256)
    assert sel.transport == "nccl" and any("InterNodeV1" in r for r in sel.reasons)
    one_host = dataclasses.replace(facts, gpu_count=1, ep_topology=EpTopology(tuple(RankPlace("h") for _ in range(8))))
    assert select_backends(one_host, knobs(combine_wire="fp8_blockwise_1x32"), a8w4, ep_size=8, num_experts=256).transport == "mori"


def test_gpu_per_node_comes_from_where_the_ranks_run_not_the_visible_gpus(fakes, monkeypatch):
    """vLLM asks whether the EP group spans nodes (all2all.py ``if not self.internode``) and passes
    ``gpu_per_node=min(8, num_ep_ranks)``. One visible GPU per process on one host is IntraNode. On the
    old code (``torch.cuda.device_count()``, 0 GPUs here -> 1 per node) this test FAILS (InterNodeV1LL)."""
    from megamoe_backend.transport.mori import ep_ranks_per_node

    one_host = EpTopology((RankPlace("h", "gpu0"), RankPlace("h", "gpu1")))
    t = make_transport(fakes, make_plan(), gpus_per_node=None, topology=one_host)
    assert (t.kernel.kernel_type, t.kernel.gpu_per_node) == ("IntraNode", 2)
    assert ep_ranks_per_node(16, EpTopology(tuple(RankPlace(f"n{r // 4}") for r in range(16)))) == 4
    with pytest.raises(TransportError, match="same number of EP ranks on every node"):
        ep_ranks_per_node(3, EpTopology((RankPlace("a"), RankPlace("a"), RankPlace("b"))))


def test_the_inter_node_kernel_switch_reads_vllms_threshold(monkeypatch):
    """vLLM reads VLLM_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD (default 256; "<= threshold -> LL", its
    test_inter_node_switch); so does the transport. On the old code (256 hard-coded) this test FAILS."""
    from megamoe_backend.transport.mori import inter_ll_max_tokens, pick_kernel

    assert inter_ll_max_tokens({}) == 256
    assert inter_ll_max_tokens({"VLLM_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD": "128"}) == 128
    with pytest.raises(KnobError, match="VLLM_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD='lots'"):
        inter_ll_max_tokens({"VLLM_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD": "lots"})
    assert pick_kernel(16, 8, 129, "gfx950", 128).kernel_type == "InterNodeV1"
    assert pick_kernel(16, 8, 128, "gfx950", 128).kernel_type == "InterNodeV1LL"
    monkeypatch.setenv("VLLM_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD", "1000")
    assert inter_ll_max_tokens() == 1000


def test_a4w4_runs_correctly_unfused_over_mori_with_local_experts(fakes):
    """A4W4 over mori's v1 op with the torch experts (here: no aiter installed on a gfx1250 host)."""
    sel = select_backends(rocm_facts("gfx1250", triton=False, aiter=False), selection_knobs(dispatch_wire="fp4"),
                          ExpertMath("a4w4"), ep_size=2, num_experts=E)
    assert (sel.fused, sel.provider, sel.transport) == (False, "torch", "mori")
    ep, t_per_rank = 2, 4
    weights = _weights("a4w4", seed=3)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(t_per_rank, H, generator=g).to(torch.bfloat16) for _ in range(ep)]
    ids = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t_per_rank)]) for _ in range(ep)]
    tw = [torch.rand(t_per_rank, K, generator=g) for _ in range(ep)]
    fakes.mori.ops.EpDispatchCombineOp.FABRIC_GENERATION = "gfx1250-a4w4"

    def rank(r):
        spec = MoESpec(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K, quant="a4w4")
        plan = build_plan(spec, Knobs(dispatch_wire="fp4", max_tokens_per_rank=16), ep_rank=r, ep_size=ep, backends=sel)
        layer = MegaMoELayer(plan, _local(weights, r * E // ep, (r + 1) * E // ep), transport=make_transport(fakes, plan))
        return layer(xs[r], ids[r], tw[r])

    got = torch.cat(run_ranks(rank, ep))
    want = MegaMoELayer(make_plan(rank=0, ep=1, wire="fp4", quant="a4w4"), weights)(torch.cat(xs), torch.cat(ids), torch.cat(tw))
    assert rel_l2(got.float(), want.float()) < 1e-2
