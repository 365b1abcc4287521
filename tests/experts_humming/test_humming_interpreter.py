"""The humming provider on the CPU: its own kernels under the Triton interpreter (TRITON_INTERPRET=1), humming's
indexed GEMM emulated as its adapter promises it (emulation.py; the GPU test holds the real one to the same).

Checked: every pair row against the provider's torch twin (twin.py, step by step) and the fp32 reference
(A8W4 relL2 < 0.10), with and without the SwiGLU clamp; the combine wire rows (bf16 written by GEMM2 itself,
fp8_blockwise_1x32 by the finalize kernel) bit for bit ``wire.encode`` of ``forward``; a destination per
segment over live rows, where only the live pairs are computed and humming is asked to walk exactly the live
tiles; the eager forward's pairs (not row-major: gathered); the bf16 wire (quantised on the receiver); a
scratch that a second forward does not grow; pairs that run elsewhere (slot -1) left untouched.

Planted mutations, each run once on this module (branch issue58, 2026-12-07), each failing here: gate and up
swapped in swiglu_a2_kernel (test_rows_match_the_twin_and_the_reference: worst pair row relL2 1.19 vs the
twin); the route weight left out of GEMM2's row scale (same test, 35.6); the A operand in frag8's K order
(FRAG8_ORDER=True in the provider, same test, 1.69); humming told one tile fewer than the layout's live tiles
(live_tiles - 1 in _padded_rows: test_live_rows_walk_only_the_live_tiles, a live pair's row never written).
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; test_gpu_humming.py covers CUDA", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
import triton.language.standard as std  # noqa: E402

if type(std._elementwise_max).__name__ != "InterpretedFunction":
    pytest.skip("Triton was imported before TRITON_INTERPRET=1 (run this directory on its own: "
                "pytest tests/experts_humming)", allow_module_level=True)

from emulation import EmulatedLibrary  # noqa: E402
from twin import TWIN_TOL, twin_block_forward, twin_forward  # noqa: E402

from megamoe_backend.experts import ExpertMath, ExpertPairs, TorchReferenceExperts, quantize_expert_weights  # noqa: E402
from megamoe_backend.experts.humming.provider import HummingExperts  # noqa: E402
from megamoe_backend.experts.live import LiveRows, SegmentDest  # noqa: E402
from megamoe_backend.experts.scratch import ExpertsScratch  # noqa: E402
from megamoe_backend.formats import quantize_mx  # noqa: E402
from megamoe_backend.formats.block_fp8 import quantize_groups  # noqa: E402
from megamoe_backend.formats.wire import combine_wire  # noqa: E402
from megamoe_backend.layer.reference import rel_l2  # noqa: E402

E, H, INTER, K = 3, 128, 128, 2
HB, IB = 256, 256  # block-FP8: two 1 x 128 groups a row on both GEMMs, so a scale written at the wrong group shows


def problem(tokens=6, limit=None, layout="interleaved", seed=0, masked=0.0, fmt="mxfp4"):
    """(provider, prepared weights, row-major weights, quantised rows (MX fp8; fp8_g128 for ``fmt`` "fp8_block",
    at HB x IB with plain rows), bf16 rows, row-major pairs, math)."""
    block = fmt == "fp8_block"
    h, inter = (HB, IB) if block else (H, INTER)
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(E, h, inter, generator=g) / inter**0.5
    weights = quantize_expert_weights(w1, w2, fmt, "plain" if block else layout)
    x = (torch.randn(tokens, h, generator=g) * 2).to(torch.bfloat16)
    ids = torch.rand(tokens, E, generator=g).topk(K, dim=1).indices.reshape(-1)
    if masked:
        ids = torch.where(torch.rand(ids.shape, generator=g) < masked, -1, ids)
    pairs = ExpertPairs(torch.arange(tokens).repeat_interleave(K), ids.contiguous(), torch.rand(tokens * K, generator=g),
                        per_row=K)
    math = ExpertMath("fp8_block" if block else "a8w4", swiglu_limit=limit)
    provider = HummingExperts(capacity=64 * K, library=EmulatedLibrary(block_m=16))
    rows = quantize_groups(x) if block else quantize_mx(x, "fp8")
    return provider, provider.prepare_weights(weights, math), weights, rows, x, pairs, math


def assert_rows_near(got, want, rows=None):
    rows = range(got.shape[0]) if rows is None else rows
    worst = max(float(rel_l2(got[q], want[q])) for q in rows)
    assert worst < TWIN_TOL, f"worst pair row relL2 {worst:.3g} vs the twin (tolerance {TWIN_TOL})"


@pytest.mark.parametrize("limit", [None, 1.0], ids=["no-clamp", "clamp"])
@pytest.mark.parametrize("layout", ["interleaved", "plain"])
def test_rows_match_the_twin_and_the_reference(limit, layout):
    provider, prepared, weights, rows, _, pairs, math = problem(limit=limit, layout=layout)
    got = provider.forward(rows, pairs, prepared, math)
    assert_rows_near(got, twin_forward(rows, pairs, weights, math))
    ref = TorchReferenceExperts().forward(rows, pairs, weights, math)
    assert float(rel_l2(got, ref)) < 0.10


@pytest.mark.parametrize("wire_name", ["bf16", "fp8_blockwise_1x32"])
def test_wire_rows_are_the_forward_encoded(wire_name):
    provider, prepared, _, rows, _, pairs, math = problem()
    wire = combine_wire(wire_name)
    got = provider.forward_wire(rows, pairs, prepared, math, wire)
    assert torch.equal(got, wire.encode(provider.forward(rows, pairs, prepared, math)))


def test_live_rows_walk_only_the_live_tiles():
    """Two segments of 8 rows, 3 and 1 of them live: only those pairs' rows reach their destinations (the rest
    of the output keeps its fill), and humming is asked to walk exactly the live pairs' tiles."""
    provider, prepared, weights, _, x, _, math = problem(tokens=16, seed=3)
    rows = quantize_mx(x, "fp8")
    seg_rows, counts = 8, torch.tensor([3, 1])
    g = torch.Generator().manual_seed(5)
    slots = torch.rand(16, E, generator=g).topk(K, dim=1).indices.reshape(-1).contiguous()
    pairs = ExpertPairs(torch.arange(16).repeat_interleave(K), slots, torch.rand(16 * K, generator=g), per_row=K)
    wire = combine_wire("bf16")
    rb = wire.row_bytes(H)
    base = torch.tensor([0, 20 * rb])  # segment 1's rows start 20 rows in
    out = torch.full((40 * rb,), 0x7F, dtype=torch.uint8)
    dest = SegmentDest(base, seg_rows * K, rb, align=16)
    live = LiveRows(counts, seg_rows, config_pairs=None)
    provider.forward_wire(rows, pairs, prepared, math, wire, out=out, dest=dest, live=live)
    want = wire.encode(twin_forward(rows, pairs, weights, math))
    live_pairs = [q for q in range(16 * K) if q // K % seg_rows < int(counts[q // K // seg_rows])]
    for q in range(16 * K):
        at = int(base[q // (seg_rows * K)]) + (q % (seg_rows * K)) * rb
        row = out[at:at + rb]
        if q in live_pairs:
            got = wire.decode_fp32(row[None], H)[0]
            assert float(rel_l2(got, wire.decode_fp32(want[q][None], H)[0])) < TWIN_TOL, f"pair {q}"
        else:
            assert bool((row == 0x7F).all()), f"pair {q} is not live but was written"
    bm = 16
    per_expert = torch.bincount(slots[live_pairs], minlength=E)
    tiles = int(((per_expert + bm - 1) // bm).sum())
    walked = [s.walked for s in provider.library.sublayers.values()]
    assert walked == [[tiles * bm], [tiles * bm]]


def test_pairs_that_are_not_row_major_are_gathered():
    provider, prepared, weights, rows, _, pairs, math = problem(seed=7)
    perm = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(1))
    shuffled = ExpertPairs(pairs.row[perm].contiguous(), pairs.slot[perm].contiguous(), pairs.weight[perm].contiguous())
    got = provider.forward(rows, shuffled, prepared, math)
    assert_rows_near(got, twin_forward(rows, shuffled, weights, math))


def test_bf16_rows_are_quantised_on_the_receiver():
    provider, prepared, weights, _, x, pairs, math = problem(seed=2)
    got = provider.forward(x, pairs, prepared, math)
    assert_rows_near(got, twin_forward(quantize_mx(x, "fp8"), pairs, weights, math))


@pytest.mark.parametrize("fmt, wire_name", [("mxfp4", "fp8_blockwise_1x32"), ("fp8_block", "bf16"),
                                           ("fp8_block", "fp8_blockwise_1x32")])
def test_a_second_forward_allocates_nothing_and_masked_pairs_are_untouched(fmt, wire_name):
    """A second forward allocates nothing; pairs routed elsewhere are untouched; the live rows are the forward's
    encoded and near the twin. Block-FP8's first forward takes bf16 rows (quantised to fp8_g128 on the receiver):
    the same bits as its fp8_g128 rows."""
    block = fmt == "fp8_block"
    provider, prepared, weights, rows, x, pairs, math = problem(masked=0.3, seed=4, fmt=fmt)
    hidden = HB if block else H
    scratch = ExpertsScratch("cpu")
    wire = combine_wire(wire_name)
    out = torch.full((len(pairs), wire.row_bytes(hidden)), 0x7F, dtype=torch.uint8)
    provider.forward_wire(x if block else rows, pairs, prepared, math, wire, out=out, scratch=scratch)
    allocated = scratch.allocations
    provider.forward_wire(rows, pairs, prepared, math, wire, out=out, scratch=scratch)
    assert scratch.allocations == allocated
    masked = pairs.slot < 0
    assert bool(masked.any()) and bool((out[masked] == 0x7F).all())
    live = ~masked
    assert torch.equal(out[live], wire.encode(provider.forward(rows, pairs, prepared, math))[live])
    want = wire.encode((twin_block_forward if block else twin_forward)(rows, pairs, weights, math))
    assert_rows_near(wire.decode_fp32(out[live], hidden), wire.decode_fp32(want[live], hidden))


@pytest.mark.parametrize("rows_in,wire_name", [("bf16", "bf16"), ("mx", "fp8_blockwise_1x32")])
def test_the_scratch_is_what_megamoe_info_counts(rows_in, wire_name):
    """The "humming.*" buffers a forward reserves at the provider's capacity are footprint.humming_scratch_bytes
    (what layer/memory.py adds to `megamoe info`), give or take each buffer's rounding to 16 bytes and the
    one-element tile counts and stream-K locks (counters, not per row)."""
    from megamoe_backend.experts.humming.footprint import humming_scratch_bytes

    provider, prepared, _, rows, x, pairs, math = problem()
    scratch = ExpertsScratch("cpu")
    provider.forward_wire(x if rows_in == "bf16" else rows, pairs, prepared, math, combine_wire(wire_name),
                          scratch=scratch)
    want = humming_scratch_bytes(provider.capacity, provider.capacity // K, H, INTER, bf16_rows_in=rows_in == "bf16",
                                 gemm2_in_place=wire_name == "bf16")
    small = 2 * 16 + provider.library.locks("cpu").numel() * 4  # humming.rows1 / rows2 + humming.locks
    got = scratch.bytes_named("humming.")
    assert want <= got <= want + small + 16 * 8, (got, want)


def test_weights_from_elsewhere_are_refused():
    provider, prepared, weights, rows, _, pairs, math = problem()
    with pytest.raises(ValueError, match="must come from its prepare_weights"):
        HummingExperts(library=EmulatedLibrary()).forward(rows, pairs, prepared, math)
    with pytest.raises(ValueError, match="run a8w4 on mxfp4 weights"):
        provider.prepare_weights(weights, ExpertMath("a4w4"))


# ----------------------------------------------------------------------------------------------- block-FP8
def block_problem(**kw):
    return problem(fmt="fp8_block", **kw)


@pytest.mark.parametrize("limit", [None, 1.0], ids=["no-clamp", "clamp"])
def test_block_fp8_rows_match_the_twin_and_the_reference(limit):
    """Planted mutations, each failing here (run once, 2026-12-07): gate and up read swapped in swiglu_g128_kernel;
    the route weight left out of the A2 group scales; A2's group scale written one group over."""
    provider, prepared, weights, rows, _, pairs, math = block_problem(limit=limit)
    assert prepared.storage == "humming" and prepared.fmt == "fp8_block" and prepared.w1_row_scale is None
    got = provider.forward(rows, pairs, prepared, math)
    assert_rows_near(got, twin_block_forward(rows, pairs, weights, math))
    ref = TorchReferenceExperts().forward(rows, pairs, weights, math)
    assert float(rel_l2(got, ref)) < 0.06  # the block-FP8 gate (the torch experts' own error to fp32 is ~0.04)


def test_block_fp8_scratch_is_what_megamoe_info_counts():
    from megamoe_backend.experts.humming.footprint import humming_scratch_bytes

    provider, prepared, _, rows, _, pairs, math = block_problem()
    scratch = ExpertsScratch("cpu")
    provider.forward_wire(rows, pairs, prepared, math, combine_wire("fp8_blockwise_1x32"), scratch=scratch)
    want = humming_scratch_bytes(provider.capacity, provider.capacity // K, HB, IB, bf16_rows_in=False,
                                 gemm2_in_place=False, block_fp8=True)
    small = 2 * 16 + provider.library.locks("cpu").numel() * 4
    got = scratch.bytes_named("humming.")
    assert want <= got <= want + small + 16 * 8, (got, want)


def test_block_fp8_schemes_are_not_mixed():
    provider, prepared, weights, rows, _, pairs, _ = block_problem()
    with pytest.raises(ValueError, match="run fp8_block on fp8_block weights"):
        provider.prepare_weights(weights, ExpertMath("a8w4"))
    with pytest.raises(ValueError, match="no row-major form"):
        prepared.dequantized()


@pytest.mark.parametrize("quant, wire, combine", [("a8w4", "fp8", "bf16"), ("a8w4", "fp8", "fp8_blockwise_1x32"),
                                                  ("a8w4", "bf16", "bf16"), ("fp8_block", "fp8", "bf16"),
                                                  ("fp8_block", "bf16", "fp8_blockwise_1x32")])
def test_the_layers_device_forward_equals_its_torch_forward(quant, wire, combine):
    """MegaMoELayer with the humming provider injected: the device forward (row-major pairs, GEMM1 deriving the
    rows -- block-FP8: the sender's fp8_g128 workspace rows copied for humming --, GEMM2 writing the combine rows or
    the finalize kernel) bit for bit the torch forward (its pairs gathered per pair), both within the scheme's gate
    of the fp32 reference (A8W4 0.10, block-FP8 0.06)."""
    from megamoe_backend.knobs import Knobs
    from megamoe_backend.layer import MegaMoELayer, fp32_reference_moe
    from megamoe_backend.plan import build_plan
    from megamoe_backend.spec import preset
    from megamoe_backend.transport import clear_transport_cache
    from megamoe_backend.workload import ProblemConfig, make_problem

    block = quant == "fp8_block"
    h, inter = (HB, IB) if block else (128, 128)
    spec = preset("dsv4-pro").scaled(hidden_size=h, moe_intermediate_size=inter, n_routed_experts=8)
    k = spec.num_experts_per_tok
    p = make_problem(ProblemConfig(spec, 5, 1, seed=3, masked_fraction=0.2))
    plan = build_plan(spec, Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=64), quant=quant)
    weights = p.expert_weights(quant)
    clear_transport_cache()
    try:
        outs = []
        for device_path in (True, False):
            provider = HummingExperts(capacity=64 * k, library=EmulatedLibrary())
            layer = MegaMoELayer(plan, weights, provider=provider, device_path=device_path)
            assert (layer.workspace is not None) == device_path and layer.weights.storage == "humming"
            outs.append(layer(p.x, p.topk_ids, p.topk_weights))
    finally:
        clear_transport_cache()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    layout = "plain" if block else "interleaved"
    ref = fp32_reference_moe(p.x, p.topk_ids, p.topk_weights, *weights.dequantized(), layout, spec.swiglu_limit)
    assert float(rel_l2(outs[0].float(), ref)) < (0.06 if block else 0.10)
