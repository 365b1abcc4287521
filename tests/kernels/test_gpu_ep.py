"""The device P2P forward (MEGA_DISPATCH=ipc) with 2 and 4 rank processes on ONE CUDA GPU.

Ranks are processes sharing cuda:0, each with its own arena, mapped by the others through CUDA
IPC (torch symmetric memory refuses several ranks on one GPU). What is shown, per EP size:
- every (quant, dispatch wire, combine wire) case: bit-identical to the ep_size-1 device forward
  on the same tokens (all experts on one rank), and within the accuracy gates vs fp32;
- eager forwards issue no host synchronisation (``set_sync_debug_mode("error")``);
- one forward captured in a CUDA graph on every rank, replayed with new tokens and routing
  (30 % masked), equals eager bit for bit; an idle rank (0 tokens) takes part, eager and replayed;
- a bad expert id on one rank is raised there (naming layer and token), the others are unaffected
  and the group goes on; ranks that disagree on ``max_tokens_across_ranks`` get an error;
- a peer that dies after start-up (before a forward, or mid-forward: after the dispatch barrier)
  ends the survivors' forward within MEGA_P2P_TIMEOUT_S, with an
  error naming the layer, the waiting rank and the dead one; the GPU context survives, later
  forwards of that shape refuse at once (MEGA_ON_PEER_TIMEOUT=raise; the default ends the
  process: tests/kernels/test_gpu_watchdog.py);
- the peer-arena handshake passes on IPC arenas and fails on every rank naming a rank that never
  writes its token; MEGA_DISPATCH=auto resolves to ipc (ranks share the GPU) after the handshake.
Skips without CUDA. Timing with ranks time-slicing one GPU is a proxy: `megamoe bench layer --ep N`.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the interpreter tests cover the P2P kernels on CPU)", allow_module_level=True)
pytest.importorskip("triton")

from benchmarks.bench_experts import make_weights  # noqa: E402
from megamoe_backend.knobs import Knobs  # noqa: E402
from megamoe_backend.layer import MegaMoELayer, fp32_reference_moe, rel_l2  # noqa: E402
from megamoe_backend.parallel.spawn import spawn_ranks  # noqa: E402
from megamoe_backend.plan import build_plan  # noqa: E402
from megamoe_backend.spec import preset  # noqa: E402
from megamoe_backend.transport import clear_transport_cache  # noqa: E402

SPEC = preset("dsv4-pro").scaled(n_routed_experts=16)  # hidden 7168, intermediate 3072, top-6
K = SPEC.num_experts_per_tok
MTPR, T = 64, 24
GATES = {"bf16": 0.01, "a8w4": 0.10, "a4w4": 0.28}
CASES = [("bf16", "bf16", "bf16"), ("a8w4", "fp8", "bf16"), ("a8w4", "fp8", "fp8_blockwise_1x32"),
         ("a4w4", "fp4", "bf16"), ("a8w4", "bf16", "bf16")]
GRAPH_CASE = ("a8w4", "fp8", "fp8_blockwise_1x32")
DEAD_TIMEOUT_S = 3.0


def routing(tokens, seed, masked=0.2, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, SPEC.hidden_size, generator=g, device=device).to(torch.bfloat16)
    ids = torch.rand(tokens, SPEC.n_routed_experts, generator=g, device=device).topk(K, dim=1).indices
    ids = torch.where(torch.rand(tokens, K, generator=g, device=device) < masked, torch.full_like(ids, -1), ids)
    w = torch.rand(tokens, K, generator=g, device=device)
    return x, ids, w / w.sum(1, keepdim=True)


_WEIGHTS: dict = {}  # this process's weights (each rank process makes the same ones from the seed)


def all_weights(device):
    if not _WEIGHTS:
        _WEIGHTS["w"] = make_weights(SPEC.n_routed_experts, SPEC.hidden_size, SPEC.moe_intermediate_size, device, seed=11)
    return _WEIGHTS["w"]


def ep_layer(rank, world, quant, wire, combine, weights, mtpr=MTPR, timeout_s=30.0, name=None, transport="ipc",
             on_peer_timeout="exit"):
    import torch.distributed as dist

    from megamoe_backend.workload.problem import local_weights

    knobs = Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=mtpr, transport=transport,
                  p2p_timeout_s=timeout_s, on_peer_timeout=on_peer_timeout)
    plan = build_plan(SPEC, knobs, rank, world, quant=quant, device_type="cuda")
    fp4, bf16 = weights
    layer = MegaMoELayer(plan, local_weights(bf16 if quant == "bf16" else fp4, plan.placement, rank).to("cuda"),
                         group=dist.group.WORLD, device="cuda", name=name)
    assert layer.workspace is not None and layer.plan.backends.transport == "ipc", "MEGA_DISPATCH=ipc must take the P2P forward"
    return layer


def _worker(rank, world):
    """Everything one rank does, in the order every rank does it (the forwards are collective)."""
    torch.cuda.set_device(0)
    weights = all_weights(torch.device("cuda"))
    x, ids, w = routing(T, seed=100 + rank)
    res = {"inputs": (x.cpu(), ids.cpu(), w.cpu()), "cases": {}}
    for case in CASES:
        layer = ep_layer(rank, world, *case, weights)
        layer(x, ids, w, max_tokens_across_ranks=T)  # compiles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = layer(x, ids, w, max_tokens_across_ranks=T)
            full = layer(x, ids, w)  # receive regions sized by MEGA_MAX_TOKENS_PER_RANK
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        layer.raise_if_bad_input()
        res["cases"][case] = (out.cpu(), torch.equal(out, full))

    # one forward captured in a graph on every rank, replayed with new data (rank world-1 idle in round 2)
    layer = ep_layer(rank, world, *GRAPH_CASE, weights, name="graph layer")
    idle = rank == world - 1
    for tokens in (T, 0 if idle else T):
        xs, ids_s, ws = (t.clone() for t in routing(tokens, seed=7 + rank))
        layer(xs, ids_s, ws, max_tokens_across_ranks=T)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_s = layer(xs, ids_s, ws, max_tokens_across_ranks=T)
        same = []
        for i in range(3):
            nx, nids, nw = routing(tokens, seed=1000 + 10 * i + rank, masked=0.3)
            xs.copy_(nx), ids_s.copy_(nids), ws.copy_(nw)
            graph.replay()
            torch.cuda.synchronize()
            replayed = out_s.clone()
            eager = layer(nx, nids, nw, max_tokens_across_ranks=T)
            torch.cuda.synchronize()
            same.append(torch.equal(replayed, eager) and replayed.shape[0] == tokens)
        res.setdefault("graph_equal", []).append(same)
        del graph
    layer.raise_if_bad_input()

    # a bad id on rank 0: raised there, nowhere else; the group goes on
    bad_ids = ids.clone()
    if rank == 0:
        bad_ids[3, 1] = 999
    layer(x, bad_ids, w, max_tokens_across_ranks=T)
    torch.cuda.synchronize()
    try:
        layer.raise_if_bad_input()
        res["bad_id"] = None
    except ValueError as exc:
        res["bad_id"] = str(exc)
    after = layer(x, ids, w, max_tokens_across_ranks=T)
    torch.cuda.synchronize()
    layer.raise_if_bad_input()
    res["after_bad"] = after.cpu()

    # ranks disagree on the rows per source: an error, not garbage
    layer(x, ids, w, max_tokens_across_ranks=T + 8 * (rank == 0))
    torch.cuda.synchronize()
    try:
        layer.raise_if_bad_input()
        res["mismatch"] = None
    except Exception as exc:  # noqa: BLE001 - the test checks the type and text
        res["mismatch"] = f"{type(exc).__name__}: {exc}"
    clear_transport_cache()
    return res


def _dead_peer_worker(rank, world, phase):
    torch.cuda.set_device(0)
    weights = all_weights(torch.device("cuda"))
    # MEGA_ON_PEER_TIMEOUT=raise: the raise at the next eager call (the default, exit, is test_gpu_watchdog.py's)
    layer = ep_layer(rank, world, "a8w4", "fp8", "bf16", weights, timeout_s=DEAD_TIMEOUT_S, name="layer 7",
                     on_peer_timeout="raise")
    x, ids, w = routing(T, seed=100 + rank)
    layer(x, ids, w, max_tokens_across_ranks=T)  # one good forward together
    torch.cuda.synchronize()
    layer.raise_if_bad_input()
    import torch.distributed as dist

    dist.barrier()
    if rank == world - 1:
        if phase == 1:  # dies mid-forward: its rows are dispatched and it passed barrier 0, never barrier 1
            steps = layer.path.steps(x, ids, w, 1.0, None, T)
            assert next(steps) == "dispatch"
            barrier_0 = next(steps)
            assert barrier_0.phase == 0
            barrier_0.launch()
            torch.cuda.synchronize()
        os._exit(0)  # dies without a word
    time.sleep(1.0)
    start = time.monotonic()
    layer(x, ids, w, max_tokens_across_ranks=T)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    res = {"elapsed": elapsed}
    try:
        layer.raise_if_bad_input()
        res["error"] = None
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
    start = time.monotonic()
    try:
        layer(x, ids, w, max_tokens_across_ranks=T)
        res["again"] = None
    except Exception as exc:  # noqa: BLE001
        res["again"] = f"{type(exc).__name__}: {exc}"
    res["again_s"] = time.monotonic() - start
    res["context_ok"] = float(torch.ones(4, device="cuda").sum().item()) == 4.0
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def ep_run(request):
    world = request.param
    results = spawn_ranks(world, _worker, backend="gloo", timeout_s=1200, pg_timeout_s=600)
    return world, results


def _reference(world, results, case):
    """The ep_size-1 device forward on all ranks' tokens, in this process."""
    quant, wire, combine = case
    clear_transport_cache()
    fp4, bf16 = all_weights(torch.device("cuda"))
    plan = build_plan(SPEC, Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=MTPR * world), quant=quant,
                      device_type="cuda")
    layer = MegaMoELayer(plan, bf16 if quant == "bf16" else fp4, device="cuda")
    x, ids, w = (torch.cat([r["inputs"][i] for r in results]).cuda() for i in range(3))
    out = layer(x, ids, w).cpu()
    ref = fp32_reference_moe(x, ids, w, bf16.w1.float(), bf16.w2.float(), "interleaved", SPEC.swiglu_limit).cpu()
    clear_transport_cache()
    return out, ref


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_ep_equals_ep1_and_meets_the_gate(ep_run, case):
    """The EP claim is the bits (the ep_size-1 device forward with the same wires is the exact twin),
    the gate the accuracy claim. Planted mutations of the P2P dispatch (layer/device/p2p.py: the route weights x 1.05 as dispatched, the first E8M0 block of every dispatched fp8 row one binade
    high, and the pair of (rank 0, token 1, k 0) sent with no slot)
    were run once (tree 2377c6c + issue 46) against this check's CPU twin,
    test_p2p_interpreter.py::test_ep_forward_equals_the_ep1_device_forward: each failed its bit check."""
    world, results = ep_run
    ep1, fp32 = _reference(world, results, case)
    got = torch.cat([r["cases"][case][0] for r in results])
    assert all(r["cases"][case][1] for r in results), "max_tokens_across_ranks=T and the MTPR-sized regions must agree"
    assert torch.equal(got.view(torch.int16), ep1.view(torch.int16)), f"ep{world} != ep1 for {case}"
    assert rel_l2(got.float(), fp32) < GATES[case[0]]


def test_graph_replays_equal_eager_and_idle_ranks_take_part(ep_run):
    world, results = ep_run
    for rank, r in enumerate(results):
        assert r["graph_equal"] == [[True] * 3, [True] * 3], f"rank {rank}: {r['graph_equal']}"


def test_bad_id_is_raised_on_its_rank_only_and_the_group_goes_on(ep_run):
    world, results = ep_run
    assert "topk_ids holds 999 at token 3" in results[0]["bad_id"] and "graph layer" in results[0]["bad_id"]
    assert all(r["bad_id"] is None for r in results[1:])
    ep1, _ = _reference(world, results, GRAPH_CASE)
    assert torch.equal(torch.cat([r["after_bad"] for r in results]).view(torch.int16), ep1.view(torch.int16))


def test_ranks_that_disagree_on_rows_per_source_get_an_error(ep_run):
    world, results = ep_run
    for r in results:
        assert r["mismatch"] is not None and r["mismatch"].startswith("TransportError") and "max_tokens_across_ranks" in r["mismatch"]


@pytest.mark.parametrize("world,phase", [(2, 0), (4, 0), (2, 1)], ids=["ep2-before", "ep4-before", "ep2-mid-forward"])
def test_a_dead_peer_ends_the_others_within_the_timeout(world, phase):
    results = spawn_ranks(world, _dead_peer_worker, phase, backend="gloo", timeout_s=900, pg_timeout_s=600,
                          tolerate_exit=True)
    assert results[-1] is None  # the dead rank
    for rank, r in enumerate(results[:-1]):
        assert DEAD_TIMEOUT_S - 0.5 < r["elapsed"] < DEAD_TIMEOUT_S + 2.0, r  # one timeout per step, not per barrier
        assert r["error"] is not None and r["error"].startswith("PeerTimeoutError"), r
        assert f"ep_rank {rank} waited" in r["error"] and "layer 7" in r["error"], r
        assert "MEGA_P2P_TIMEOUT_S=3s" in r["error"], r
        assert r["again"] is not None and "PeerTimeoutError" in r["again"] and r["again_s"] < 1.0, r
        assert r["context_ok"], r
    where = "dispatch (its token rows)" if phase == 0 else "combine (its expert rows)"
    assert all(f"for ep_rank {world - 1} at the {where} barrier" in r["error"] for r in results[:-1])


def _handshake_worker(rank, world):
    """The peer-arena handshake on CUDA IPC arenas, a rank that does not answer, and MEGA_DISPATCH=auto."""
    torch.cuda.set_device(0)
    import torch.distributed as dist

    from megamoe_backend.platform.topology import gather_ep_topology
    from megamoe_backend.transport.handshake import HandshakeError, agree, await_tokens, handshake
    from megamoe_backend.transport.peer_arena import ArenaLayout, make_arena

    group, device = dist.group.WORLD, torch.device("cuda", 0)
    lay = ArenaLayout.build(world, 4, 2, 512, 512)
    arena = make_arena("ipc", lay, group, device)
    start = time.monotonic()
    handshake(arena, group, 5.0)
    res = {"pass_s": time.monotonic() - start, "header": arena.local[lay.header : lay.header + 8 * world].view(torch.int64).tolist()}
    silent = make_arena("ipc", lay, group, device)
    start = time.monotonic()
    try:
        if rank == world - 1:  # never writes its token: takes part in the agreement only
            agree(silent, await_tokens(silent, 1.0), group, 1.0)
        else:
            handshake(silent, group, 1.0)
        res["silent"] = None
    except HandshakeError as exc:
        res["silent"] = str(exc)
    res["silent_s"] = time.monotonic() - start
    topology = gather_ep_topology(group, device)
    res["topology"] = (len(topology.hosts), topology.shares_gpu, topology.missing_peer_access())

    weights = all_weights(device)
    x, ids, w = routing(T, seed=100 + rank)
    auto = ep_layer(rank, world, *GRAPH_CASE, weights, transport="auto", name="auto layer")
    ipc = ep_layer(rank, world, *GRAPH_CASE, weights, name="ipc layer")
    res["auto"] = (auto.plan.backends.transport, auto.plan.backends.reasons, auto.workspace is ipc.workspace)
    out_auto = auto(x, ids, w, max_tokens_across_ranks=T)
    out_ipc = ipc(x, ids, w, max_tokens_across_ranks=T)
    torch.cuda.synchronize()
    res["auto_equal"] = torch.equal(out_auto, out_ipc)
    clear_transport_cache()
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_handshake_and_auto_pick_ipc_for_ranks_on_one_gpu(world):
    results = spawn_ranks(world, _handshake_worker, backend="gloo", timeout_s=900, pg_timeout_s=300)
    for rank, r in enumerate(results):
        assert r["pass_s"] < 2.0 and r["header"] == [0] * world, r  # passed without waiting, header as built
        assert r["silent"] is not None and f"ep_rank(s) [{world - 1}] did not answer" in r["silent"], r
        assert 1.0 <= r["silent_s"] < 10.0, r
        assert r["topology"] == (1, True, []), r  # one host, a shared GPU, nothing unreachable
        transport, reasons, same_workspace = r["auto"]
        assert transport == "ipc" and same_workspace, r  # auto lands on exactly the ipc path
        assert any("ranks share a GPU" in why and "handshake passed" in why for why in reasons), reasons
        assert r["auto_equal"], rank


def _symm_worker(rank, world):
    torch.cuda.set_device(0)
    weights = all_weights(torch.device("cuda"))
    import torch.distributed as dist

    from megamoe_backend.workload.problem import local_weights

    knobs = Knobs(dispatch_wire="fp8", max_tokens_per_rank=MTPR, transport="symm")
    plan = build_plan(SPEC, knobs, rank, world, quant="a8w4", device_type="cuda")
    try:
        MegaMoELayer(plan, local_weights(weights[0], plan.placement, rank).to("cuda"), group=dist.group.WORLD, device="cuda")
        return None
    except Exception as exc:  # noqa: BLE001 - the test checks type and text
        return f"{type(exc).__name__}: {exc}"


def test_symmetric_memory_with_two_ranks_on_one_gpu_is_a_clear_error():
    """torch symmetric memory refuses several ranks on one GPU; the start-up error says what to use."""
    results = spawn_ranks(2, _symm_worker, backend="gloo", timeout_s=300, pg_timeout_s=30)
    assert results[0] == results[1] and results[0] is not None, results  # agreed: the same error on both ranks
    r = results[0]
    assert r.startswith("TransportError") and "MEGA_DISPATCH=symm" in r and "MEGA_DISPATCH=ipc" in r, r


def _failed_open_worker(rank, world):
    """MEGA_DISPATCH=auto with rank 1 unable to open its peers' IPC arenas (injected): every rank must
    land on nccl with the same reason, or, with an engine that captures graphs, refuse the start."""
    import logging

    torch.cuda.set_device(0)
    from megamoe_backend.plan.capture import EngineGraphs, GraphCaptureError
    from megamoe_backend.transport import peer_arena
    from megamoe_backend.workload.problem import local_weights

    import torch.distributed as dist

    if rank == 1:
        def broken(handle, device):
            raise RuntimeError("injected: cudaIpcOpenMemHandle failed")
        peer_arena._open = broken
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("megamoe").addHandler(handler)
    weights = all_weights(torch.device("cuda"))
    res = {}
    for name, graphs in (("eager", None), ("graphs", EngineGraphs(True, "--enforce-eager"))):
        clear_transport_cache()
        plan = build_plan(SPEC, Knobs(dispatch_wire="fp8", max_tokens_per_rank=MTPR), rank, world, quant="a8w4",
                          device_type="cuda")
        start = time.monotonic()
        try:
            layer = MegaMoELayer(plan, local_weights(weights[0], plan.placement, rank).to("cuda"), group=dist.group.WORLD,
                                 device="cuda", graphs=graphs)
            res[name] = {"transport": layer.plan.backends.transport, "path": layer.transport_name}
        except GraphCaptureError as exc:
            res[name] = {"refused": str(exc)}
        res[name]["seconds"] = time.monotonic() - start
    res["lines"] = lines
    return res


def test_a_failed_ipc_open_on_one_rank_is_nccl_on_every_rank_or_a_refusal():
    results = spawn_ranks(2, _failed_open_worker, backend="gloo", timeout_s=600, pg_timeout_s=120)
    why = "opening its peers' arenas failed on 1 of 2 rank(s) (ep_rank 1: RuntimeError: injected: cudaIpcOpenMemHandle failed)"
    for rank, r in enumerate(results):
        assert r["eager"]["transport"] == "nccl" and r["eager"]["seconds"] < 60, r
        assert "Add --enforce-eager" in r["graphs"]["refused"] and why in r["graphs"]["refused"], r
        assert any(f"ep_rank {rank}: transport nccl (MEGA_DISPATCH=auto)" in line and why in line for line in r["lines"]), r
    assert results[0]["graphs"]["refused"] == results[1]["graphs"]["refused"]
