"""The device P2P forward (layer/device/p2p.py, transport/peer_arena.py) under the Triton
interpreter, on CPU: the new kernels against torch references, and whole EP forwards with gloo
rank processes whose arenas are shared-memory files (the CPU stand-in for CUDA IPC).

Checked here: the dispatch kernel's rows, (slot, weight) entries, header (rows, tokens), pair owners,
bad-id and NaN reports, in two "ranks" of one tensor; the barrier (passes when every peer
signalled, times out naming the peer and phase when one did not, skips waiting after a timeout,
detects ranks that disagree on rows per source); GEMM2 through a destination table (and one base
per segment) equals GEMM2 in pair order, rows moved; EP 2 and 4 (an idle rank) bit-identical to the ep_size-1 device forward
for every quant x wire (block-FP8 included: fp8_g128 rows quantised by the sender, equal to
formats.block_fp8.quantize_groups bit for bit, handed to the experts as views of the arena), within the
gates, both with max_tokens_across_ranks (5 rows per source region, as every
rank's header shows) and without it (MEGA_MAX_TOKENS_PER_RANK = 8 rows); a peer that dies after start-up ends the other's forward
with PeerTimeoutError naming layer, rank and peer. GPU runs (2 and 4 ranks on one H200, graphs,
sync-debug): tests/kernels/test_gpu_ep.py.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from interpreter_guard import require_interpreter  # noqa: E402

require_interpreter("tests/kernels/test_gpu_ep.py")

from megamoe_backend.experts import ExpertPairs  # noqa: E402
from megamoe_backend.experts.triton import TritonExperts  # noqa: E402
from megamoe_backend.formats import MXTensor, combine_wire, quantize_mx  # noqa: E402
from megamoe_backend.formats.block_fp8 import quantize_groups  # noqa: E402
from megamoe_backend.formats.wire import a_format_wire, encode_group_rows  # noqa: E402
from megamoe_backend.knobs import Knobs  # noqa: E402
from megamoe_backend.layer.device import p2p  # noqa: E402
from megamoe_backend.layer.device.status import (  # noqa: E402
    BAD_EXPERT_ID, NONFINITE_INPUT, PEER_TIMEOUT, ROWS_MISMATCH, InputStatus,
)
from megamoe_backend.parallel.spawn import spawn_ranks  # noqa: E402
from megamoe_backend.plan import build_plan  # noqa: E402
from megamoe_backend.spec import preset  # noqa: E402
from megamoe_backend.transport.peer_arena import ArenaLayout, PeerArena  # noqa: E402

SPEC = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8)
K = SPEC.num_experts_per_tok
H = SPEC.hidden_size
# block-FP8 EP runs at hidden 256: two 1x128 groups a row, so a scale written at the wrong group changes the result
SPEC_OF = {"fp8_block": SPEC.scaled(hidden_size=256)}
GATES = {"bf16": 0.01, "a8w4": 0.10, "a4w4": 0.28, "fp8_block": 0.06}  # fp8_block: docs/block-fp8.md's gate


def two_rank_arenas(fmt: str, mtpr: int = 8, combine: str = "bf16", hidden: int = H) -> list[PeerArena]:
    """Two ranks' arenas as two halves of one tensor (one process: the kernels only see offsets)."""
    row_bytes = a_format_wire(None if fmt == "bf16" else fmt).row_bytes(hidden)
    lay = ArenaLayout.build(2, mtpr, K, row_bytes, combine_wire(combine).row_bytes(hidden))
    whole = torch.zeros(2 * lay.total, dtype=torch.uint8)
    halves = [whole[: lay.total], whole[lay.total :]]
    return [PeerArena(lay, r, halves[r], halves) for r in range(2)]


def reference_dispatch(x, ids, weights, owner, slot, fmt, rows_per_src, arenas):
    """What the dispatch of rank ``me`` must leave in every arena (torch, from the formats module)."""
    t = x.shape[0]
    if fmt == "bf16":
        rows = x.to(torch.bfloat16).view(torch.uint8).view(t, 2 * x.shape[1])
    elif fmt == "fp8_g128":  # block-FP8's A format: e4m3, then the fp32 scales' bytes (formats.block_fp8)
        rows = encode_group_rows(quantize_groups(x.float()))
    else:
        q = quantize_mx(x.float(), fmt)
        rows = torch.cat([q.data, q.scales], dim=1)
    lay = arenas[0].layout
    expect = {}
    for r, arena in enumerate(arenas):
        slots = torch.full((rows_per_src, K), -1, dtype=torch.int64)
        wts = torch.zeros(rows_per_src, K)
        known = (ids >= 0) & (ids < owner.shape[0])
        safe = torch.where(known, ids, 0)
        here = known & (owner[safe] == r)
        slots[:t] = torch.where(here, slot[safe], -1)
        wts[:t] = torch.where(here, weights, 0.0)
        slots[t:], wts[t:] = 3, 3.0  # past T: the stale entries stay (receivers read T rows: the header)
        goes = here.any(dim=1)
        expect[r] = (slots, wts, goes, rows)
    return expect, lay


# hidden 640: 20 blocks of 32, three pieces of a row per token (the last one partial); prefill's wider
# pieces: 16 blocks (two pieces, the last partial), 32 and 64 (one piece, 12 / 44 blocks masked)
@pytest.mark.parametrize("fmt,hidden,blocks", [("bf16", H, None), ("fp8", H, None), ("fp4", H, None), ("bf16", 640, None),
                                               ("fp8", 640, None), ("fp4", 640, None), ("fp8", 640, 16), ("fp4", 640, 32),
                                               ("bf16", 640, 32), ("fp8", 640, 64), ("fp8_g128", H, None),
                                               ("fp8_g128", 640, None), ("fp8_g128", 640, 16), ("fp8_g128", 1152, 32)])
def test_dispatch_kernel_writes_rows_entries_and_tables(fmt, hidden, blocks):
    g = torch.Generator().manual_seed(5)
    t, rows_per_src = 5, 8
    x = torch.randn(t, hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, 8, (t, K), generator=g)
    weights = torch.rand(t, K, generator=g)
    owner = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    slot = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    arenas = two_rank_arenas(fmt, hidden=hidden)
    for arena in arenas:  # stale entries of an earlier, larger batch: rewritten for t < T, left (and never read) past it
        arena.view(arena.layout.recv_slot, 2 * 8 * K, torch.int64).fill_(3)
        arena.view(arena.layout.recv_weight, 2 * 8 * K, torch.float32).fill_(3.0)
    me = 1
    pair_live = torch.full((8 * K,), 77, dtype=torch.int64)
    status = InputStatus(torch.device("cpu"), 8)
    p2p.dispatch(x, ids, weights, owner, slot, rows_per_src, arenas[me], fmt, hidden, pair_live, status.word, 0,
                 blocks=blocks)
    assert status.word.tolist() == [0, 0, 0, 0]
    expect, lay = reference_dispatch(x, ids, weights, owner, slot, fmt, rows_per_src, arenas)
    for r, arena in enumerate(arenas):
        slots, wts, goes, rows = expect[r]
        got_slot = arena.view(lay.recv_slot, 2 * 8 * K, torch.int64).view(2 * 8, K)
        got_w = arena.view(lay.recv_weight, 2 * 8 * K, torch.float32).view(2 * 8, K)
        region = slice(me * rows_per_src, (me + 1) * rows_per_src)
        assert torch.equal(got_slot[region], slots) and torch.equal(got_w[region], wts)
        assert torch.equal(got_slot[: rows_per_src], torch.full((rows_per_src, K), 3))  # the other source's region
        got_rows = arena.view(lay.recv_rows, 2 * 8 * lay.row_bytes, torch.uint8).view(2 * 8, lay.row_bytes)
        for i in range(t):
            if goes[i]:
                assert torch.equal(got_rows[me * rows_per_src + i], rows[i]), (r, i)
            else:
                assert not got_rows[me * rows_per_src + i].any(), (r, i)  # a rank owning none of its experts gets no row
        header = arena.view(lay.header, 4, torch.int64)
        assert int(header[me]) == rows_per_src and int(header[2 + me]) == t  # rows per source, tokens sent
    known = (ids >= 0) & (ids < 8)
    assert torch.equal(pair_live[: t * K], torch.where(known, owner[torch.where(known, ids, 0)], -1).view(-1))
    assert torch.equal(pair_live[t * K :], torch.full((8 * K - t * K,), 77))  # past T: untouched


def test_dispatch_pieces_widen_only_at_prefill_sizes():
    """Decode keeps 256-column pieces (many programs for few rows); prefill widens them while
    MIN_PROGRAMS programs remain; a width that is no power of two is refused."""
    assert [p2p.blocks_per_program(t, 7168) for t in (0, 1, 8, 36, 37, 73, 74, 127, 128, 8192)] == \
        [8, 8, 8, 8, 16, 16, 32, 32, 32, 32]
    for t in (1, 8, 32, 64, 128, 512, 2048, 8192):
        b = p2p.blocks_per_program(t, 7168)
        assert b == 8 or t * -(-224 // b) >= p2p.MIN_PROGRAMS
    with pytest.raises(ValueError, match="blocks per program must be a power of two"):
        p2p.dispatch(torch.zeros(1, H), torch.zeros(1, K, dtype=torch.int64), torch.zeros(1, K), torch.zeros(8, dtype=torch.int64),
                     torch.zeros(8, dtype=torch.int64), 8, two_rank_arenas("fp8")[0], "fp8", H, torch.zeros(8 * K, dtype=torch.int64),
                     torch.zeros(4, dtype=torch.int64), 0, blocks=24)


def test_an_idle_rank_dispatches_its_header_only():
    arenas = two_rank_arenas("fp8")
    for arena in arenas:
        arena.view(arena.layout.header, 4, torch.int64).fill_(-5)
    status = InputStatus(torch.device("cpu"), 8)
    owner, slot = torch.tensor([0] * 4 + [1] * 4), torch.tensor([0, 1, 2, 3] * 2)
    p2p.dispatch(torch.zeros(0, H), torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K), owner, slot, 8, arenas[0],
                 "fp8", H, torch.full((8 * K,), -1), status.word, 0)
    for arena in arenas:
        assert arena.view(arena.layout.header, 4, torch.int64).tolist() == [8, -5, 0, -5]
    assert status.word.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("hidden,nan_col,fmt", [(H, 17, "fp8"), (640, 600, "fp8"), (640, 600, "fp8_g128")])  # 600: the last piece
def test_dispatch_reports_the_first_bad_id_and_a_nan_row(hidden, nan_col, fmt):
    t = 4
    x = torch.randn(t, hidden)
    x[2, nan_col] = float("nan")
    ids = torch.zeros(t, K, dtype=torch.int64)
    ids[1, 3] = 8
    arenas = two_rank_arenas(fmt, hidden=hidden)
    owner, slot = torch.tensor([0] * 4 + [1] * 4), torch.tensor([0, 1, 2, 3] * 2)
    status = InputStatus(torch.device("cpu"), 8)
    args = (torch.full((8 * K,), -1), status.word)
    p2p.dispatch(x, ids, torch.rand(t, K), owner, slot, 8, arenas[0], fmt, hidden, *args, 4)
    assert status.word.tolist() == [BAD_EXPERT_ID, 4, 8, 1]  # token 1's program runs before token 2's here
    status.word.zero_()
    ids[1, 3] = 0
    p2p.dispatch(x, ids, torch.rand(t, K), owner, slot, 8, arenas[0], fmt, hidden, *args, 4)
    assert status.word.tolist()[0] == NONFINITE_INPUT and status.word.tolist()[3] == 2
    with pytest.raises(ValueError, match="hidden_states row 2 holds NaN/Inf"):
        status.host.copy_(status.word)
        status.raise_if_bad({4: "layer 4"})


def test_barrier_passes_times_out_and_checks_rows_per_source():
    arenas = two_rank_arenas("bf16")
    lay = arenas[0].layout
    budget = p2p.wait_budget(0.5, torch.device("cpu"))
    epochs = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
    words = [torch.zeros(4, dtype=torch.int64) for _ in range(2)]
    for r in range(2):
        arenas[r].view(lay.header, 2, torch.int64).fill_(8)
    # rank 1 signals first (it would wait for rank 0 now; give it a zero budget), then rank 0 passes at once
    p2p.barrier(arenas[1], epochs[1], 0, 0, 8, words[1], 0)
    assert words[1].tolist()[0] == PEER_TIMEOUT  # rank 0 had not arrived: a zero budget times out
    start = time.perf_counter()
    p2p.barrier(arenas[0], epochs[0], 0, budget, 8, words[0], 0)
    assert words[0].tolist() == [0, 0, 0, 0] and time.perf_counter() - start < 0.5
    # phase 1: rank 0 alone, rank 1 never comes: times out within about the budget, naming peer 1 and the phase
    start = time.perf_counter()
    p2p.barrier(arenas[0], epochs[0], 1, budget, 8, words[0], 3)
    spent = time.perf_counter() - start
    assert words[0].tolist() == [PEER_TIMEOUT, 3, 1, 1]
    assert 0.1 < spent < 5.0
    # a later barrier of the same step signals but does not wait again
    start = time.perf_counter()
    p2p.barrier(arenas[0], epochs[0], 0, budget, 8, words[0], 3)
    assert time.perf_counter() - start < 0.3
    # rows per source: rank 1 assumed 6 rows
    words[0].zero_()
    arenas[0].view(lay.header, 2, torch.int64)[1] = 6
    arenas[0].view(lay.flags, 4, torch.int64)[1] = 1 << 40  # rank 1 "arrived" at every epoch
    p2p.barrier(arenas[0], epochs[0], 0, budget, 8, words[0], 2)
    assert words[0].tolist() == [ROWS_MISMATCH, 2, 6, 1]


def test_gemm2_through_a_destination_table_moves_rows_only():
    g = torch.Generator().manual_seed(2)
    from megamoe_backend.workload import ProblemConfig, make_problem

    problem = make_problem(ProblemConfig(SPEC, 6, 1, seed=4))
    plan = build_plan(SPEC, Knobs(dispatch_wire="fp8", combine_wire="fp8_blockwise_1x32"), quant="a8w4")
    provider = TritonExperts()
    weights = provider.prepare_weights(problem.expert_weights("a8w4"), plan.math)
    p = 12
    q = quantize_mx(problem.x[:6].float(), "fp8")
    rows = MXTensor(q.data, q.scales, "fp8")
    pairs = ExpertPairs(row=torch.arange(p) // 2, slot=torch.randint(-1, 8, (p,), generator=g),
                        weight=torch.rand(p, generator=g))
    wire = plan.combine
    plain = provider.forward_wire(rows, pairs, weights, plan.math, wire)
    width = wire.row_bytes(H)
    perm = torch.randperm(p, generator=g)
    base = torch.full((p + 3, width), 0xAB, dtype=torch.uint8)
    dest = (perm + 3) * width  # row i goes to row perm[i] + 3 of the base
    provider.forward_wire(rows, pairs, weights, plan.math, wire, out=base, dest=dest)
    ran = pairs.slot >= 0
    assert torch.equal(base[perm[ran] + 3], plain[ran])
    assert (base[:3] == 0xAB).all() and (base[perm[~ran] + 3] == 0xAB).all()  # pairs that did not run: nothing written
    with pytest.raises(ValueError, match="dest: expected contiguous int64"):
        provider.forward_wire(rows, pairs, weights, plan.math, wire, out=base, dest=dest[:-1])


# ----------------------------------------------------------------------------- EP forwards
def _ep_worker(rank, world, quant, wire, combine, tokens, idle, mtpr):
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    from megamoe_backend.layer import MegaMoELayer
    from megamoe_backend.workload import ProblemConfig, make_problem
    from megamoe_backend.workload.problem import local_weights

    spec = SPEC_OF.get(quant, SPEC)
    problem = make_problem(ProblemConfig(spec, tokens, world, seed=3, masked_fraction=0.2))
    knobs = Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=mtpr, transport="ipc")
    plan = build_plan(spec, knobs, rank, world, quant=quant, backends=("triton", "ipc"))
    weights = local_weights(problem.expert_weights(quant), plan.placement, rank)
    layer = MegaMoELayer(plan, weights, group=dist.group.WORLD, provider=TritonExperts(capacity=mtpr * K * world),
                         device_path=True)
    lo = rank * tokens
    hi = lo if rank in idle else lo + tokens
    inputs = (problem.x[lo:hi], problem.topk_ids[lo:hi], problem.topk_weights[lo:hi])
    arena = layer.workspace.arena
    ws = layer.workspace
    received = ws.wire.view(ws.recv_rows, spec.hidden_size)  # what the experts get: views of the arena rows, no copy per forward
    views = getattr(received, "data", received).data_ptr() == ws.recv_rows.data_ptr()
    header = lambda: arena.view(arena.layout.header, 2 * world, torch.int64).tolist()  # noqa: E731  [B per source, T per source]
    out = layer(*inputs, max_tokens_across_ranks=tokens)
    layer.raise_if_bad_input()
    bounded_header = header()
    dist.barrier()  # every rank read its header before any peer's next dispatch rewrites it
    unbounded = layer(*inputs)  # the same step sized by MEGA_MAX_TOKENS_PER_RANK
    layer.raise_if_bad_input()
    return {"out": out, "unbounded": unbounded, "bounded_header": bounded_header, "unbounded_header": header(),
            "takes_token_bound": layer.takes_token_bound, "views": views, "wire": ws.wire.mx, "ws_type": type(layer.workspace).__name__, "arena": arena.name}


def _ep1(quant, wire, combine, tokens, world, idle, mtpr):
    from megamoe_backend.layer import MegaMoELayer, fp32_reference_moe
    from megamoe_backend.transport import clear_transport_cache
    from megamoe_backend.workload import ProblemConfig, make_problem

    clear_transport_cache()
    spec = SPEC_OF.get(quant, SPEC)
    problem = make_problem(ProblemConfig(spec, tokens, world, seed=3, masked_fraction=0.2))
    plan = build_plan(spec, Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=mtpr * world), quant=quant)
    layer = MegaMoELayer(plan, problem.expert_weights(quant), provider=TritonExperts(capacity=mtpr * K * world), device_path=True)
    keep = torch.cat([torch.arange(r * tokens, (r + 1) * tokens) for r in range(world) if r not in idle])
    out = layer(problem.x[keep], problem.topk_ids[keep], problem.topk_weights[keep])
    ref = fp32_reference_moe(problem.x[keep], problem.topk_ids[keep], problem.topk_weights[keep],
                             *problem.expert_weights(quant).dequantized(), "plain" if quant == "fp8_block" else "interleaved",
                             spec.swiglu_limit)
    clear_transport_cache()
    return out, ref


EP_CASES = [(2, ("bf16", "bf16", "bf16"), ()), (2, ("a8w4", "fp8", "fp8_blockwise_1x32"), ()),
            (4, ("a4w4", "fp4", "bf16"), (1,)), (2, ("a8w4", "bf16", "bf16"), (0,)),
            # block-FP8: fp8_g128 rows quantised by the sender, on the fp8 wire and (the same rows) on the bf16 one
            (2, ("fp8_block", "fp8", "bf16"), ()), (2, ("fp8_block", "bf16", "fp8_blockwise_1x32"), (1,))]


@pytest.mark.parametrize("world,case,idle", EP_CASES, ids=[f"ep{w}-{'-'.join(c)}-idle{list(i)}" for w, c, i in EP_CASES])
def test_ep_forward_equals_the_ep1_device_forward(world, case, idle):
    from megamoe_backend.layer import rel_l2

    tokens, mtpr = 5, 8  # max_tokens_across_ranks=5: the receive regions hold 5 rows per source, not 8
    results = spawn_ranks(world, _ep_worker, *case, tokens, idle, mtpr, timeout_s=900)
    assert all(r["ws_type"] == "P2PWorkspace" and r["arena"] == "ipc" and r["takes_token_bound"] for r in results)
    assert all(r["views"] for r in results)
    if case[0] == "fp8_block":  # the sender's fp8_g128 rows travel whatever MEGA_DISPATCH_WIRE says (bf16: the same bits)
        assert all(r["wire"] == "fp8_g128" for r in results)
    sent = [0 if r in idle else tokens for r in range(world)]
    for r in results:  # every source sized its region by the bound, then by MTPR without it
        assert r["bounded_header"] == [tokens] * world + sent, r["bounded_header"]
        assert r["unbounded_header"] == [mtpr] * world + sent, r["unbounded_header"]
    got = torch.cat([r["out"] for r in results])
    assert all(results[r]["out"].shape[0] == 0 for r in idle)
    ep1, fp32 = _ep1(*case, tokens, world, idle, mtpr)
    assert torch.equal(got.view(torch.int16), ep1.view(torch.int16))
    assert torch.equal(torch.cat([r["unbounded"] for r in results]).view(torch.int16), ep1.view(torch.int16))
    assert rel_l2(got.float(), fp32) < GATES[case[0]]


def _ipc_layer(rank, world, seed, name, startup_timeout_s, provider_cls=None):
    """(layer, problem) of one interpreter rank over ipc, MEGA_P2P_TIMEOUT_S=2, raising on a peer timeout."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    from megamoe_backend.layer import MegaMoELayer
    from megamoe_backend.workload import ProblemConfig, make_problem
    from megamoe_backend.workload.problem import local_weights

    problem = make_problem(ProblemConfig(SPEC, 3, world, seed=seed))
    knobs = Knobs(dispatch_wire="bf16", max_tokens_per_rank=4, transport="ipc", p2p_timeout_s=2.0,
                  p2p_startup_timeout_s=startup_timeout_s, on_peer_timeout="raise")
    plan = build_plan(SPEC, knobs, rank, world, quant="bf16", backends=("triton", "ipc"))
    provider = (provider_cls or TritonExperts)(capacity=4 * K * world)
    layer = MegaMoELayer(plan, local_weights(problem.expert_weights("bf16"), plan.placement, rank),
                         group=dist.group.WORLD, provider=provider, device_path=True, name=name)
    return layer, problem


def _dead_worker(rank, world):
    import torch.distributed as dist

    from megamoe_backend.transport import PeerTimeoutError

    # the peer dies before the first forward, a start-up forward: its bound is set as short here
    layer, problem = _ipc_layer(rank, world, 3, "layer 9", startup_timeout_s=2.0)
    dist.barrier()
    if rank == 1:
        os._exit(0)
    x, ids, w = problem.x[:3], problem.topk_ids[:3], problem.topk_weights[:3]
    start = time.monotonic()
    layer(x, ids, w)
    spent = time.monotonic() - start
    errors = []
    for _ in range(2):
        try:
            layer(x, ids, w)
            errors.append(None)
        except PeerTimeoutError as exc:
            errors.append(str(exc))
    return {"spent": spent, "errors": errors}


def test_a_dead_peer_ends_the_forward_with_a_named_error():
    results = spawn_ranks(2, _dead_worker, timeout_s=600, tolerate_exit=True)
    assert results[1] is None
    r = results[0]
    assert r["spent"] < 30, r  # the interpreter's spin budget is calibrated to MEGA_P2P_TIMEOUT_S=2
    first, again = r["errors"]
    assert first and "layer 9: ep_rank 0 waited more than MEGA_P2P_TIMEOUT_S=2s for ep_rank 1 at the dispatch" in first
    assert again == first  # the group cannot continue: refused at once


LATE_S = 8.0  # a rank this late to a barrier (a slow first compile) is 4x the steady bound below


def _forwards_with_a_late_rank(rank, layer, problem, forwards) -> dict:
    """Run ``forwards`` ((name, token bound or None, rank 1 late?) each) on both ranks: per name None, or
    the PeerTimeoutError text this rank's forward raised."""
    import torch.distributed as dist

    from megamoe_backend.transport import PeerTimeoutError

    x, ids, w = problem.x[:3], problem.topk_ids[:3], problem.topk_weights[:3]
    result = {}
    for name, bound, late in forwards:
        dist.barrier()
        if rank == 1 and late:
            time.sleep(LATE_S)  # as a rank still compiling its kernels would be
        try:
            layer(x, ids, w, max_tokens_across_ranks=bound)
            layer.raise_if_bad_input()
            result[name] = None
        except PeerTimeoutError as exc:
            result[name] = str(exc)
    return result


def _late_worker(rank, world):
    layer, problem = _ipc_layer(rank, world, 4, "layer 5", startup_timeout_s=120.0)
    return _forwards_with_a_late_rank(rank, layer, problem, (("start-up", None, True), ("steady", None, True)))


def test_a_late_rank_passes_the_start_up_forward_and_times_out_later():
    """The start-up forward waits up to MEGA_P2P_STARTUP_TIMEOUT_S, so a peer late by 4x
    MEGA_P2P_TIMEOUT_S (compiling) ends nobody; the same lateness in a later forward is a timeout."""
    results = spawn_ranks(2, _late_worker, timeout_s=600)
    assert results[0]["start-up"] is None, results[0]
    assert results[0]["steady"] and "waited more than MEGA_P2P_TIMEOUT_S=2s for ep_rank 1" in results[0]["steady"]


class _KeyedByBound(TritonExperts):
    """Under the interpreter every bucket runs one config (config.INTERPRETER_CONFIG), so no bound brings
    new kernels; this provider keys its kernels by the bound instead, as the GPU's bucket tables do for
    bounds in different buckets (tests/core/test_startup_wait.py checks the real key)."""

    def kernel_key(self, weights, pairs, live, device):
        return None if live is None else live.config_pairs


def _new_config_worker(rank, world):
    layer, problem = _ipc_layer(rank, world, 5, "layer 6", startup_timeout_s=120.0, provider_cls=_KeyedByBound)
    return _forwards_with_a_late_rank(rank, layer, problem,
                                      (("start-up", 3, False), ("new config", 4, True), ("seen config", 4, True)))


def test_a_forward_on_new_kernels_waits_with_the_start_up_bound():
    """After start-up, a forward whose bound brings GEMM kernels its workspace never launched (every rank
    compiles them then) waits up to MEGA_P2P_STARTUP_TIMEOUT_S: a peer late by 4x MEGA_P2P_TIMEOUT_S ends
    nobody; the same lateness on kernels already launched is a timeout (startup_wait.py)."""
    results = spawn_ranks(2, _new_config_worker, timeout_s=600)
    assert results[0]["start-up"] is None and results[0]["new config"] is None, results[0]
    assert results[0]["seen config"] and "waited more than MEGA_P2P_TIMEOUT_S=2s for ep_rank 1" in results[0]["seen config"]
