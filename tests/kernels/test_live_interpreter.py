"""Work bounded by the live rows (experts/live.py), under the Triton interpreter, on CPU.

Checked here: the layout over LiveRows reads and places the live heads of each segment only (stale
slots past them never become rows) and leaves live_tiles on the device, 0 outside its ``active``
range; the experts over LiveRows + SegmentDest write exactly what the plain forward writes for the
live pairs, and nothing for stale ones; the tile config picked on the device when no bound is
given; the one-process emulated EP forward (benchmarks/emulated_ep.py) bit-identical to the ep_size-1
device forward (bf16 wires; uneven DP batches with an idle rank; bound passed or not) and within
the gates for A8W4 / A4W4. The same on an H200 with graphs and timing: tests/kernels/test_gpu_ep.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from interpreter_guard import require_interpreter  # noqa: E402

require_interpreter("tests/kernels/test_gpu_ep.py")

from megamoe_backend.experts import ExpertPairs  # noqa: E402
from megamoe_backend.experts.live import LiveRows, SegmentDest  # noqa: E402
from megamoe_backend.experts.triton import TritonExperts  # noqa: E402
from megamoe_backend.experts.triton import launch_plan  # noqa: E402
from megamoe_backend.experts.triton.config import INTERPRETER_CONFIG  # noqa: E402
from megamoe_backend.experts.triton.layout import build_layout, build_layout_torch  # noqa: E402
from megamoe_backend.formats import MXTensor, quantize_mx  # noqa: E402
from megamoe_backend.knobs import Knobs  # noqa: E402
from megamoe_backend.layer import MegaMoELayer, fp32_reference_moe, rel_l2  # noqa: E402
from benchmarks.emulated_ep import EmulatedEP  # noqa: E402
from megamoe_backend.plan import build_plan  # noqa: E402
from megamoe_backend.transport import clear_transport_cache  # noqa: E402
from megamoe_backend.workload import ProblemConfig, make_problem  # noqa: E402
from megamoe_backend.workload.problem import local_weights  # noqa: E402

from small_layer import GATES, K, SPEC, fresh_transport_cache  # noqa: E402, F401 (the fixture is autouse)

H = SPEC.hidden_size


def _region(seg_rows, counts, e, g, k=K):
    """Slots of a region of len(counts) segments x seg_rows rows x k, stale values past each live head."""
    slot = torch.randint(-1, e, (len(counts) * seg_rows * k,), generator=g)
    live = torch.zeros_like(slot, dtype=torch.bool)
    for s, c in enumerate(counts):
        live[s * seg_rows * k: (s * seg_rows + c) * k] = True
    return slot, live


# the last case: 2,520 live pairs = 20 chunks, which the interpreter's 3 programs of each chunk kernel stride over
@pytest.mark.parametrize("counts,seg_rows", [((3, 0, 5), 7), ((0, 0, 0), 7), ((7, 7, 7), 7), ((1, 6, 2), 7),
                                             ((150, 0, 190, 80), 200)])
def test_layout_over_live_rows_places_the_live_heads_only(counts, seg_rows):
    g = torch.Generator().manual_seed(sum(counts))
    e, bm = 5, 4
    slot, live = _region(seg_rows, counts, e, g)
    row = torch.arange(slot.numel()) // K
    ref = build_layout_torch(torch.where(live, slot, -1), e, bm, row)  # stale pairs made "not here"
    lay = build_layout(slot, e, bm, row=row, live=LiveRows(torch.tensor(counts), seg_rows))
    n = int(lay.live_tiles[0])
    assert n == int((ref.tile_expert >= 0).sum())
    assert torch.equal(lay.tile_expert[:n], ref.tile_expert[:n])
    assert torch.equal(lay.sorted_pair[: n * bm], ref.sorted_pair[: n * bm])
    assert torch.equal(lay.sorted_row[: n * bm], ref.sorted_row[: n * bm])
    # outside its active range the layout serves nothing: the GEMMs' persistent grids exit at once
    pairs_here = int((torch.where(live, slot, -1) >= 0).sum())
    off = build_layout(slot, e, bm, row=row, live=LiveRows(torch.tensor(counts), seg_rows), active=(pairs_here, 10**6))
    assert int(off.live_tiles[0]) == 0


def test_a_bad_header_count_is_clamped_to_the_region():
    slot = torch.zeros(2 * 3 * K, dtype=torch.int64)
    lay = build_layout(slot, 2, 4, row=torch.arange(slot.numel()) // K, live=LiveRows(torch.tensor([99, -4]), 3))
    n = int(lay.live_tiles[0])  # rows past the live tiles are never written nor read
    assert int((lay.sorted_pair[: n * 4] >= 0).sum()) == 3 * K  # segment 0 whole, segment 1 none


def _a8w4_rows(n, seed):
    problem = make_problem(ProblemConfig(SPEC, n, 1, seed=seed))
    q = quantize_mx(problem.x.float(), "fp8")
    return problem, MXTensor(q.data, q.scales, "fp8")


@pytest.mark.parametrize("combine", ["bf16", "fp8_blockwise_1x32"])
def test_experts_over_live_rows_write_the_live_pairs_only(combine):
    g = torch.Generator().manual_seed(11)
    seg_rows, counts = 4, (3, 0, 2)
    problem, rows = _a8w4_rows(seg_rows * len(counts), seed=7)
    plan = build_plan(SPEC, Knobs(dispatch_wire="fp8", combine_wire=combine), quant="a8w4")
    provider = TritonExperts()
    weights = provider.prepare_weights(problem.expert_weights("a8w4"), plan.math)
    slot, live = _region(seg_rows, counts, SPEC.n_routed_experts, g)
    p = slot.numel()
    pairs = ExpertPairs(row=torch.arange(p) // K, slot=slot, weight=torch.rand(p, generator=g))
    wire = plan.combine
    width = wire.row_bytes(H)
    plain = provider.forward_wire(rows, ExpertPairs(pairs.row, torch.where(live, slot, -1), pairs.weight), weights,
                                  plan.math, wire)
    # segment s's rows go to a region of its own, in reverse segment order, two rows of gap between them
    seg_pairs = seg_rows * K
    base_rows = torch.tensor([(len(counts) - 1 - s) * (seg_pairs + 2) for s in range(len(counts))])
    base = torch.full(((seg_pairs + 2) * len(counts), width), 0xAB, dtype=torch.uint8)
    # the bases are multiples of the row width: the alignment GEMM2 may assume (SegmentDest.align)
    dest = SegmentDest(base_rows * width, seg_pairs, width, align=math.gcd(width, 16))
    provider.forward_wire(rows, pairs, weights, plan.math, wire, out=base, dest=dest,
                          live=LiveRows(torch.tensor(counts), seg_rows))
    q = torch.arange(p)
    at = base_rows[q // seg_pairs] + q % seg_pairs
    ran = live & (slot >= 0)
    assert torch.equal(base[at[ran]], plain[ran])
    written = torch.zeros(base.shape[0], dtype=torch.bool)
    written[at[ran]] = True
    assert (base[~written] == 0xAB).all()  # stale pairs (past a live head) and pairs not here: nothing written


@pytest.mark.parametrize("bad", ["not a power of two", "not dividing the row stride"])
def test_a_destination_alignment_the_rows_do_not_have_is_refused(bad):
    """SegmentDest.align lets GEMM2 store 16-byte vectors; a value that is not a power of two or does
    not divide the row stride is refused on the host, naming it, before anything is launched."""
    problem, rows = _a8w4_rows(8, seed=5)
    plan = build_plan(SPEC, Knobs(dispatch_wire="fp8"), quant="a8w4")
    provider = TritonExperts()
    weights = provider.prepare_weights(problem.expert_weights("a8w4"), plan.math)
    width = plan.combine.row_bytes(H)
    slot, _ = _region(8, (8,), SPEC.n_routed_experts, torch.Generator().manual_seed(1))
    pairs = ExpertPairs(row=torch.arange(slot.numel()) // K, slot=slot, weight=torch.ones(slot.numel()))
    base = torch.full((slot.numel(), width), 0xAB, dtype=torch.uint8)
    align = 3 if bad == "not a power of two" else 2 * (width & -width)  # twice the largest power of two dividing it
    with pytest.raises(ValueError, match="dest.align"):
        provider.forward_wire(rows, pairs, weights, plan.math, plan.combine, out=base,
                              dest=SegmentDest(torch.zeros(1, dtype=torch.int64), slot.numel(), width, align=align),
                              live=LiveRows(torch.tensor([8]), 8))
    assert (base == 0xAB).all()


def _unbounded_forwards(counts_list, seed, scratch=None):
    """For each live-row ``counts`` of a two-segment region (8 rows each): the forward over live rows
    without a bound (candidate configs, persistent GEMMs) writes each live pair's row as the plain
    forward does, bit for bit. Yields after each case, so a caller can look at the scratch."""
    g = torch.Generator().manual_seed(seed)
    seg_rows = 8
    problem, rows = _a8w4_rows(2 * seg_rows, seed=seed + 6)
    plan = build_plan(SPEC, Knobs(dispatch_wire="fp8"), quant="a8w4")
    provider = TritonExperts()
    weights = provider.prepare_weights(problem.expert_weights("a8w4"), plan.math)
    for counts in counts_list:
        slot, live = _region(seg_rows, counts, SPEC.n_routed_experts, g)
        p = slot.numel()
        pairs = ExpertPairs(row=torch.arange(p) // K, slot=slot, weight=torch.rand(p, generator=g))
        plain = provider.forward_wire(rows, ExpertPairs(pairs.row, torch.where(live, slot, -1), pairs.weight), weights,
                                      plan.math, plan.combine)
        out = torch.full_like(plain, 0xAB)
        provider.forward_wire(rows, pairs, weights, plan.math, plan.combine, out=out, scratch=scratch,
                              dest=SegmentDest(torch.tensor([0, seg_rows * K * plain.shape[1]]), seg_rows * K, plain.shape[1]),
                              live=LiveRows(torch.tensor(counts), seg_rows))
        ran = live & (slot >= 0)
        assert torch.equal(out[ran], plain[ran]), counts
        yield counts


def test_the_tile_config_is_picked_on_the_device_without_a_bound(monkeypatch):
    """Two candidate configs (decode-sized BM 16, region-sized BM 32): whichever the live pair count
    picks, the rows are the plain forward's, bit for bit, and the launches of the config not picked
    (no live tile: they claim nothing) leave the claim counters zero."""
    from megamoe_backend.experts.scratch import ExpertsScratch

    small, big = INTERPRETER_CONFIG, INTERPRETER_CONFIG.with_(block_m=32, block_n1=128, block_n2=64)
    monkeypatch.setattr(launch_plan, "default_config", lambda p, e, mode="split": small if p <= 2 * e else big)
    monkeypatch.setattr(launch_plan, "_table", lambda mode: ((2.0, small), (float("inf"), big)))
    assert launch_plan.tile_candidates(None, 64, 8, "frag8", None) == ((small, (-1, 16)), (big, (16, 2**31 - 1)))
    assert launch_plan.tile_candidates(None, 64, 8, "frag8", 12) == ((small, (-1, 2**31 - 1)),)
    # 12 pairs at most (<= 16: small) / ~90 (big)
    scratch = ExpertsScratch("cpu")
    for counts in _unbounded_forwards(((1, 1), (8, 7), (1, 0)), seed=3, scratch=scratch):
        assert scratch.counters("gemm_claims", 2).tolist() == [0, 0], counts


def test_persistent_gemms_claim_every_tile_once_and_leave_the_counters_zero():
    """Without a bound the GEMMs run persistent grids (3 programs under the interpreter) that claim
    the live tiles from one counter pair in the scratch: every launch must leave it zero, or the next
    launch (the other GEMM, another candidate, the next forward) would start past its tiles and leave
    rows unwritten. Several forwards through one scratch equal the plain forward each time."""
    from megamoe_backend.experts.scratch import ExpertsScratch

    scratch = ExpertsScratch("cpu")
    for counts in _unbounded_forwards(((8, 7), (2, 0), (8, 8)), seed=5, scratch=scratch):
        assert scratch.counters("gemm_claims", 2).tolist() == [0, 0], counts


# ------------------------------------------------------------------------------ emulated EP
def _emulated(world, quant, wire, combine, tokens, mtpr, share_scratch=False):
    problem = make_problem(ProblemConfig(SPEC, max(tokens), world, seed=3, masked_fraction=0.2))
    knobs = Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=mtpr, transport="ipc")
    plans = [build_plan(SPEC, knobs, r, world, quant=quant, backends=("triton", "ipc")) for r in range(world)]
    emu = EmulatedEP(world, plans.__getitem__,
                     lambda r: local_weights(problem.expert_weights(quant), plans[r].placement, r),
                     torch.device("cpu"), provider_for=lambda r: TritonExperts(capacity=mtpr * K * world),
                     share_scratch=share_scratch)
    per = max(tokens)
    idx = [torch.arange(r * per, r * per + tokens[r]) for r in range(world)]
    inputs = [(problem.x[i], problem.topk_ids[i], problem.topk_weights[i]) for i in idx]
    return problem, emu, inputs, torch.cat(idx)


def _ep1(problem, quant, wire, combine, keep, mtpr):
    clear_transport_cache()
    plan = build_plan(SPEC, Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=mtpr), quant=quant)
    layer = MegaMoELayer(plan, problem.expert_weights(quant), provider=TritonExperts(), device_path=True)
    out = layer(problem.x[keep], problem.topk_ids[keep], problem.topk_weights[keep])
    ref = fp32_reference_moe(problem.x[keep], problem.topk_ids[keep], problem.topk_weights[keep],
                             *problem.expert_weights(quant).dequantized(), "interleaved", SPEC.swiglu_limit)
    return out, ref


CASES = [(2, ("bf16", "bf16", "bf16"), (5, 0)), (4, ("a8w4", "fp8", "fp8_blockwise_1x32"), (0, 2, 5, 5)),
         (2, ("a4w4", "fp4", "bf16"), (3, 5)), (2, ("a8w4", "bf16", "bf16"), (5, 5))]


@pytest.mark.parametrize("world,case,tokens", CASES, ids=[f"ep{w}-{'-'.join(c)}-{t}" for w, c, t in CASES])
def test_emulated_ep_equals_the_ep1_device_forward(world, case, tokens):
    """Bit for bit the ep_size-1 device forward with the same wires, bound or not, and within the gate.
    Planted mutations of the P2P dispatch (layer/device/p2p.py: the route weights x 1.05 as dispatched, the first E8M0 block of every dispatched fp8 row one binade
    high, and the pair of (rank 0, token 1, k 0) sent with no slot), each run
    once (tree 2377c6c + issue 46): each failed the first bit check (so did
    test_p2p_interpreter.py::test_ep_forward_equals_the_ep1_device_forward, the gloo-process twin)."""
    mtpr = 8
    problem, emu, inputs, keep = _emulated(world, *case, tokens, mtpr)
    assert all(layer.transport_name == "device p2p over emulated" for layer in emu.layers)
    unbounded = torch.cat(emu.forward(inputs))
    bounded = torch.cat(emu.forward(inputs, max_tokens_across_ranks=max(tokens)))
    emu.raise_if_bad_input()
    ep1, fp32 = _ep1(problem, *case, keep, mtpr * world)
    assert torch.equal(unbounded.view(torch.int16), ep1.view(torch.int16))
    assert torch.equal(bounded.view(torch.int16), ep1.view(torch.int16))
    assert rel_l2(unbounded.float(), fp32) < GATES[case[0]]


def test_emulated_ranks_sharing_one_experts_scratch_give_the_same_rows_from_one_set():
    """EmulatedEP(share_scratch=True), what the emulated bench runs so that 8 ranks' humming scratch fits one GPU:
    every rank's output bit for bit the unshared emulator's (bound or not, an idle rank), and the ranks hold one
    set of intermediates, a rank's own, not one each (without the sharing the ranks' sets add up)."""
    world, case, tokens, mtpr = 4, ("a8w4", "fp8", "bf16"), (0, 2, 5, 5), 8
    outs, scratches = {}, {}
    for share in (False, True):
        clear_transport_cache()
        _, emu, inputs, _ = _emulated(world, *case, tokens, mtpr, share_scratch=share)
        outs[share] = [torch.cat(emu.forward(inputs)), torch.cat(emu.forward(inputs, max_tokens_across_ranks=5))]
        scratches[share] = [layer.workspace.scratch for layer in emu.layers]
    for unshared, shared in zip(outs[False], outs[True]):
        assert torch.equal(unshared.view(torch.int16), shared.view(torch.int16))
    assert all(s is scratches[True][0] for s in scratches[True])
    one_rank = max(s.bytes for s in scratches[False])
    assert scratches[True][0].bytes == one_rank < sum(s.bytes for s in scratches[False])


def test_a_bounded_forward_runs_persistent_grids_where_its_region_dwarfs_the_bound():
    """persistent_gemms: a tile grid where the region holds few more tiles than the bound's pairs fill
    (ep_size 1, decode, EP 2) or the tiles are decode-sized, persistent grids where one program per
    prefill tile of the region would launch mostly empty programs (EP 8 prefill), always without a
    bound; no live rows: the pairs are the work."""
    gemms = launch_plan.persistent_gemms
    bounded = lambda rows, k=6: LiveRows(torch.zeros(1), rows, config_pairs=rows * k)  # noqa: E731
    assert not gemms(None, 8192 * 6, 48, 128)
    assert gemms(LiveRows(torch.zeros(8), 8), 8 * 8 * 6, 48, 16)
    assert not gemms(bounded(8), 8 * 8 * 6, 48, 16)  # 72 region tiles vs 48
    assert not gemms(bounded(128), 8 * 128 * 6, 48, 16)  # 432 vs 96, decode tiles
    assert not gemms(bounded(512), 8 * 512 * 6, 48, 128)  # 240 vs 72
    assert not gemms(bounded(8192), 2 * 8192 * 6, 192, 128)  # 960 vs 576
    assert gemms(bounded(2048), 8 * 2048 * 6, 48, 128)  # 816 vs 144
    assert gemms(bounded(8192), 8 * 8192 * 6, 48, 128)  # 3120 vs 432


def test_a_bounded_forward_over_persistent_grids_equals_the_tile_grid(monkeypatch):
    """The bounded EP forward, its GEMMs forced onto persistent grids (launch_plan.persistent_gemms answering
    True), writes every rank's output as over the tile grid (False), bit for bit (uneven batches, an idle
    rank); the forwards record that they asked, so the two runs cannot be the same path."""
    world, tokens, mtpr = 4, (0, 2, 5, 5), 8
    took, forced = [], {}
    monkeypatch.setattr(launch_plan, "persistent_gemms", lambda *a: took.append(forced["persist"]) or forced["persist"])
    forced["persist"] = False
    _, emu, inputs, _ = _emulated(world, "a8w4", "fp8", "fp8_blockwise_1x32", tokens, mtpr)
    tile_grid = torch.cat(emu.forward(inputs, max_tokens_across_ranks=max(tokens)))
    emu.raise_if_bad_input()
    assert took and not any(took)
    took.clear()
    clear_transport_cache()
    forced["persist"] = True
    _, emu, inputs, _ = _emulated(world, "a8w4", "fp8", "fp8_blockwise_1x32", tokens, mtpr)
    persistent = torch.cat(emu.forward(inputs, max_tokens_across_ranks=max(tokens)))
    assert took and all(took)
    emu.raise_if_bad_input()
    assert torch.equal(persistent.view(torch.int16), tile_grid.view(torch.int16))


def test_emulated_ep_reports_a_bad_id_on_its_rank_only():
    world, tokens, mtpr = 2, (4, 4), 8
    problem, emu, inputs, keep = _emulated(world, "bf16", "bf16", "bf16", tokens, mtpr)
    x, ids, w = inputs[1]
    bad = ids.clone()
    bad[2, 1] = SPEC.n_routed_experts + 3
    emu.forward([inputs[0], (x, bad, w)])
    emu.layers[0].raise_if_bad_input()
    with pytest.raises(ValueError, match=r"topk_ids holds 11 at token 2"):
        emu.layers[1].raise_if_bad_input()
    again = torch.cat(emu.forward(inputs))  # the group goes on, correct
    ep1, _ = _ep1(problem, "bf16", "bf16", "bf16", keep, mtpr * world)
    assert torch.equal(again.view(torch.int16), ep1.view(torch.int16))


# ------------------------------------------------------------------------------ no allocation per call
ALLOCATORS = ("empty", "empty_like", "zeros", "zeros_like", "full", "full_like", "ones", "ones_like", "arange")


def _count_allocations(monkeypatch) -> list[str]:
    """Record every torch allocator call made from the experts and the device layer's modules (the
    layer's returned output, forwards/base.py, is the caller's tensor, not a buffer)."""
    import sys

    seen: list[str] = []
    for name in ALLOCATORS:
        real = getattr(torch, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(("megamoe_backend.experts", "megamoe_backend.layer.device")):
                seen.append(f"{caller}.{_name}")
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, counting)
    return seen


@pytest.mark.parametrize("wire", ["fp8", "bf16"])  # bf16: the receiver quantises the live rows into the scratch
def test_a_forward_allocates_nothing_once_one_has_run(monkeypatch, wire):
    """Hot-path rule: the experts' intermediates come from the workspace's ExpertsScratch, reserved at
    capacity by the first forward; later forwards (bound or not, other batch sizes) allocate nothing."""
    world, mtpr = 2, 8
    problem, emu, inputs, keep = _emulated(world, "a8w4", wire, "fp8_blockwise_1x32", (5, 3), mtpr)
    first = torch.cat(emu.forward(inputs))
    scratches = {id(layer.path.workspace.scratch): layer.path.workspace.scratch for layer in emu.layers}
    made = {k: s.allocations for k, s in scratches.items()}
    assert all(made.values()) and all(s.bytes > 0 for s in scratches.values())
    seen = _count_allocations(monkeypatch)
    again = torch.cat(emu.forward(inputs, max_tokens_across_ranks=5))
    smaller = emu.forward([(x[:1], ids[:1], w[:1]) for x, ids, w in inputs])
    assert seen == [] and {k: s.allocations for k, s in scratches.items()} == made
    assert torch.equal(first.view(torch.int16), again.view(torch.int16))
    assert all(o.shape[0] == 1 for o in smaller)
    monkeypatch.undo()
    ep1, _ = _ep1(problem, "a8w4", wire, "fp8_blockwise_1x32", keep, mtpr * world)
    assert torch.equal(first.view(torch.int16), ep1.view(torch.int16))


def test_the_ep1_device_forward_allocates_nothing_once_one_has_run(monkeypatch):
    problem = make_problem(ProblemConfig(SPEC, 6, 1, seed=4))
    plan = build_plan(SPEC, Knobs(dispatch_wire="fp8", combine_wire="bf16", max_tokens_per_rank=8), quant="a8w4")
    layer = MegaMoELayer(plan, problem.expert_weights("a8w4"), provider=TritonExperts(capacity=8 * K), device_path=True)
    first = layer(problem.x, problem.topk_ids, problem.topk_weights)
    scratch = layer.path.workspace.scratch
    made = scratch.allocations
    seen = _count_allocations(monkeypatch)
    again = layer(problem.x, problem.topk_ids, problem.topk_weights)
    layer(problem.x[:2], problem.topk_ids[:2], problem.topk_weights[:2])
    assert seen == [] and scratch.allocations == made > 0
    assert torch.equal(first.view(torch.int16), again.view(torch.int16))
