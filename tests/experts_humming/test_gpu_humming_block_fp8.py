"""The humming provider on block-FP8 experts (DeepSeek V3 / R1 FP8 checkpoints) on an NVIDIA Hopper GPU with
humming-kernels installed: its 128 x 128 block-scaled GEMMs for real.

Checked: the pair rows near the provider's torch twin (twin.twin_block_forward; BLOCK_TWIN_TOL below) and within the block-FP8 gate
(relL2 < 0.06) of fp32 on the dequantised weights, with and without the SwiGLU clamp; near the Triton block-FP8
experts on the same inputs; fp8_g128 rows and bf16 rows in (quantised on the receiver) giving the same bits; the
combine wire rows of a captured CUDA graph equal to eager bit for bit (bf16 written by GEMM2, fp8 by the finalize
kernel) with a scratch a replay does not grow; live rows through a per-segment destination.

Run on an H100 80GB HBM3 (2026-12-07, humming-kernels 0.1.20): with the per-row TWIN_TOL of the MXFP4 tests the rows
test failed (worst row 0.040); the same problem's figures (benchmarks/research/block_fp8_twin_spread.py,
benchmarks/results/h100_block_fp8_twin_spread.json) were: humming vs the twin 0.0175 over all rows, 0.040 worst row;
the Triton block-FP8 experts vs the twin 0.0142 / 0.035; humming vs Triton 0.0178; bf16 rows in and a second forward
bit-identical. Block-FP8 A2 is re-quantised to e4m3 from GEMM1's rows, so a last-bit difference in a row (bf16 h here,
fp32 in Triton's epilogue, the FP8 MMA's accumulation order) moves some A2 values by one e4m3 step (6-12 %): that, not
a wrong step, is the spread (a wrong step fails the CPU tests far past it: test_humming_interpreter.py's planted
mutations). The tolerances below are set from those figures. A second H100 run with them: every test passed but the
rows test at clamp 0.5, on the gate against fp32 (0.0717 > 0.06), where the provider's CPU twin and the torch
reference experts measure the same distance (``gate_for``); that test with ``gate_for`` has not run on a GPU.

Timing is the bench's: ``python -m benchmarks.bench_experts --experts 32 --tokens 8 128 1024 8192 --schemes fp8_block
--hidden 7168 --intermediate 2048 --topk 8 --humming``. Skips without CUDA, sm_90 or humming-kernels.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (test_humming_interpreter.py covers the provider on CPU)", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("humming's FP8 paths here are Hopper's (sm_90)", allow_module_level=True)
pytest.importorskip("triton")
pytest.importorskip("humming", reason="humming-kernels not installed (pip install 'megamoe-backend[humming]')")

from benchmarks.timing import capture_graph  # noqa: E402
from twin import twin_block_forward  # noqa: E402

from megamoe_backend.experts import ExpertMath, ExpertPairs, quantize_expert_weights  # noqa: E402
from megamoe_backend.experts.humming.provider import HummingExperts  # noqa: E402
from megamoe_backend.experts.live import LiveRows, SegmentDest  # noqa: E402
from megamoe_backend.experts.scratch import ExpertsScratch  # noqa: E402
from megamoe_backend.experts.triton import TritonExperts  # noqa: E402
from megamoe_backend.formats.block_fp8 import quantize_groups  # noqa: E402
from megamoe_backend.formats.wire import combine_wire  # noqa: E402
from megamoe_backend.layer.reference import fp32_reference_moe, rel_l2  # noqa: E402

DEV = torch.device("cuda")
BLOCK_TWIN_TOL = 0.03  # relL2 over all pair rows vs the twin (measured 0.0175; the Triton experts 0.0142)
BLOCK_ROW_TOL = 0.06  # the worst single row (measured 0.040; Triton 0.035): e4m3 steps of A2, docstring
E, H, INTER, K = 6, 512, 256, 4
_CACHE: dict = {}


def problem(tokens=32, limit=10.0, seed=0):
    """(prepared humming weights, provider, checkpoint weights, fp8_g128 rows, bf16 rows, pairs, math)."""
    if "w" not in _CACHE:
        g = torch.Generator().manual_seed(11)
        w1 = torch.randn(E, 2 * INTER, H, generator=g) / H**0.5
        w2 = torch.randn(E, H, INTER, generator=g) / INTER**0.5
        weights = quantize_expert_weights(w1, w2, "fp8_block", "plain").to(DEV)
        provider = HummingExperts(capacity=256 * K)
        _CACHE["w"] = (provider.prepare_weights(weights, ExpertMath("fp8_block")), provider, weights)
    prepared, provider, weights = _CACHE["w"]
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, H, generator=g) * 2).to(torch.bfloat16).to(DEV)
    ids = torch.rand(tokens, E, generator=g).topk(K, dim=1).indices.reshape(-1).to(DEV)
    pairs = ExpertPairs(torch.arange(tokens, device=DEV).repeat_interleave(K), ids.contiguous(),
                        torch.rand(tokens * K, generator=g).to(DEV), per_row=K)
    return prepared, provider, weights, quantize_groups(x), x, pairs, ExpertMath("fp8_block", swiglu_limit=limit)


def gate_for(limit, rows, pairs, weights, math, ref) -> float:
    """The block-FP8 gate (0.06) at the clamps checkpoints use (none; 10.0). A clamp that saturates most gate / up
    values (0.5 here: h has a standard deviation near 2) magnifies A's e4m3 error in the values it leaves, so no path
    of the scheme meets 0.06 there: on this problem the torch reference experts (fp32 GEMMs on the same fp8_g128 rows
    and block-FP8 weights) are 0.0716 from fp32 and the provider's twin 0.0717 (an H100 run: humming 0.0717). There
    the provider must stay within 5 % of the reference experts' own distance."""
    if limit is None or limit >= 10.0:
        return 0.06
    from megamoe_backend.experts.reference import TorchReferenceExperts

    n = ref.shape[0]
    scheme = TorchReferenceExperts().forward(rows, pairs, weights.to("cpu"), math).view(n, K, H).sum(dim=1)
    return 1.05 * float(rel_l2(scheme, ref))


def worst_row(got, want) -> float:
    return max(float(rel_l2(got[q].float().cpu(), want[q].float().cpu())) for q in range(got.shape[0]))


@pytest.mark.parametrize("limit", [None, 10.0, 0.5], ids=["no-clamp", "clamp10", "clamp0.5"])
def test_rows_match_the_twin_the_gate_and_triton(limit):
    prepared, provider, weights, rows, x, pairs, math = problem(limit=limit)
    got = provider.forward(rows, pairs, prepared, math)
    rows_cpu = type(rows)(rows.data.cpu(), rows.scales.cpu(), rows.fmt)
    pairs_cpu = ExpertPairs(pairs.row.cpu(), pairs.slot.cpu(), pairs.weight.cpu(), per_row=K)
    twin = twin_block_forward(rows_cpu, pairs_cpu, weights.to("cpu"), math)
    assert float(rel_l2(got.cpu(), twin)) < BLOCK_TWIN_TOL and worst_row(got, twin) < BLOCK_ROW_TOL
    w1, w2 = weights.dequantized()
    n = x.shape[0]
    ref = fp32_reference_moe(x.cpu(), pairs.slot.view(n, K).cpu(), pairs.weight.view(n, K).cpu(), w1.cpu(), w2.cpu(),
                             "plain", limit)
    mine = got.view(n, K, H).sum(dim=1).cpu()
    assert float(rel_l2(mine, ref)) < gate_for(limit, rows_cpu, pairs_cpu, weights, math, ref)
    tri = TritonExperts(capacity=256 * K).forward(rows, pairs, weights, math)
    assert float(rel_l2(got.cpu(), tri.cpu())) < BLOCK_TWIN_TOL
    # bf16 rows in: quantised on the receiver into the same fp8_g128 bits
    assert torch.equal(provider.forward(x, pairs, prepared, math), got)


@pytest.mark.parametrize("wire_name", ["bf16", "fp8_blockwise_1x32"])
def test_graph_replay_equals_eager_and_allocates_nothing(wire_name):
    prepared, provider, _, rows, _, pairs, math = problem(tokens=64, seed=1)
    wire = combine_wire(wire_name)
    scratch = ExpertsScratch(DEV)
    out = torch.zeros(len(pairs), wire.row_bytes(H), dtype=torch.uint8, device=DEV)

    def fn():
        return provider.forward_wire(rows, pairs, prepared, math, wire, out=out, scratch=scratch)

    fn()
    torch.cuda.synchronize()
    eager = out.clone()
    allocated = scratch.allocations
    graph = capture_graph(fn)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and scratch.allocations == allocated
    assert torch.equal(eager, wire.encode(provider.forward(rows, pairs, prepared, math)))


def test_live_rows_reach_their_segments():
    """Two segments of 16 rows, 5 and 2 live: the live pairs' rows land at their segment's destination (near the full
    forward's rows: humming's stream-K splits fewer live tiles differently, so the sums' order may differ), the rest
    of the output keeps its fill."""
    prepared, provider, weights, rows, _, pairs, math = problem(tokens=32, seed=2)
    wire = combine_wire("bf16")
    rb, seg_rows = wire.row_bytes(H), 16
    counts = torch.tensor([5, 2], device=DEV)
    base = torch.tensor([0, 80 * rb], device=DEV)
    out = torch.full((160 * rb,), 0x7F, dtype=torch.uint8, device=DEV)
    dest = SegmentDest(base, seg_rows * K, rb, align=16)
    provider.forward_wire(rows, pairs, prepared, math, wire, out=out, dest=dest, live=LiveRows(counts, seg_rows, None))
    want = wire.encode(provider.forward(rows, pairs, prepared, math)).cpu()
    out = out.cpu()
    for q in range(len(pairs)):
        seg, within = q // (seg_rows * K), q % (seg_rows * K)
        at = int(base[seg]) + within * rb
        row = out[at:at + rb]
        if within // K < int(counts[seg]):
            got = wire.decode_fp32(row[None], H)[0]
            assert float(rel_l2(got, wire.decode_fp32(want[q][None], H)[0])) < BLOCK_ROW_TOL, f"pair {q}"
        else:
            assert bool((row == 0x7F).all()), f"pair {q} is not live but was written"
