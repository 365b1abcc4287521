"""The Triton block-FP8 experts (decoder block_fp8) under the Triton interpreter, on CPU.

Checked here: the receiver's row quantiser into fp8_g128 equals formats.quantize_groups bit for bit; the
experts equal an independent numpy twin of their arithmetic (tests/core/block_fp8_twin.py: per 128-wide
K step an exact sum rounded to fp32, times the weight block's then the A group's fp32 scale) bit for bit,
with and without the SwiGLU clamp, from bf16 rows (quantised on the receiver) and from fp8_g128 rows; they
stay within fp32 rounding of the torch experts (experts/reference.py); forward_wire equals the encode of
forward; over LiveRows they write the live pairs only; a second forward on a scratch allocates nothing;
mismatched schemes and decoders are refused. The GPU (FP8 tensor cores, graphs, DeepSeek V3 shapes):
tests/kernels/test_gpu_block_fp8.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from interpreter_guard import require_interpreter  # noqa: E402

require_interpreter("tests/kernels/test_gpu_block_fp8.py")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # the independent twin lives beside the CPU tests

from block_fp8_twin import np_stepwise_experts  # noqa: E402
from expert_problems import make_problem  # noqa: E402
from megamoe_backend.experts import ExpertMath, ExpertPairs, TorchReferenceExperts  # noqa: E402
from megamoe_backend.experts.live import LiveRows, SegmentDest  # noqa: E402
from megamoe_backend.experts.scratch import ExpertsScratch  # noqa: E402
from megamoe_backend.experts.triton import TritonExperts  # noqa: E402
from megamoe_backend.experts.triton.quant import encode_wire_rows, quantize_rows  # noqa: E402
from megamoe_backend.formats.block_fp8 import quantize_groups  # noqa: E402
from megamoe_backend.formats.wire import combine_wire, dispatch_wire  # noqa: E402
from megamoe_backend.layer.reference import rel_l2  # noqa: E402

H = I = 256  # two 128-wide K steps in each GEMM, two GEMM1 N tiles, four GEMM2 N tiles (INTERPRETER_BLOCK_FP8)
MATH = ExpertMath("fp8_block")


def _problem(n_exp=4, tokens=7, topk=3, seed=0):
    return make_problem("fp8_block", "plain", n_exp=n_exp, hidden=H, inter=I, tokens=tokens, topk=topk, seed=seed)


def _twin(weights, x, pairs, limit=None) -> torch.Tensor:
    np_ = lambda t: t.contiguous().numpy()  # noqa: E731
    got = np_stepwise_experts(np_(x.float()), np_(pairs.row), np_(pairs.slot), np_(pairs.weight),
                              np_(weights.w1.view(torch.uint8)), np_(weights.w1_scale),
                              np_(weights.w2.view(torch.uint8)), np_(weights.w2_scale), limit)
    return torch.from_numpy(got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_rows_quantiser_equals_formats(dtype):
    """quantize_rows / encode_wire_rows "fp8_g128" (the receiver's and the sender's quantisation) equal
    formats.quantize_groups / WireFormat.encode: scales (max(amax, 1e-10) / 448, IEEE division) and bytes."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 512, generator=g) * torch.logspace(-12, 12, 9)[:, None]).to(dtype)
    x[4] = 0.0  # an all-zero row: scale 1e-10 / 448, bytes 0
    ref = quantize_groups(x)
    got = quantize_rows(x, "fp8_g128")
    assert torch.equal(got.scales, ref.scales)
    assert torch.equal(got.data, ref.data)
    wire = dispatch_wire("fp8", "fp8_g128")
    assert torch.equal(encode_wire_rows(x, "fp8_g128"), wire.encode(x))


@pytest.mark.parametrize("limit", [None, 0.25])
@pytest.mark.parametrize("rows_fmt", ["bf16", "fp8_g128"])
def test_experts_equal_the_stepwise_twin(limit, rows_fmt):
    """Bit for bit the twin's arithmetic (limit 0.25 clamps a good share of gates and ups at these scales);
    within fp32 rounding of the torch experts (fp64 sums over whole K), which the twin's arithmetic shares."""
    weights, x, pairs = _problem(seed=1 if limit else 0)
    math = ExpertMath("fp8_block", swiglu_limit=limit)
    rows = x if rows_fmt == "bf16" else quantize_groups(x)
    got = TritonExperts().forward(rows, pairs, weights, math)
    assert torch.equal(got, _twin(weights, x, pairs, limit))
    ref = TorchReferenceExperts().forward(x, pairs, weights, math)
    # fp32 rounding of a few K steps' partial sums (~1e-7 relative); an A2 element rounded to the other e4m3
    # neighbour (the sums differ in their last bits) would move a row by ~1e-2 / sqrt(I): 1e-5 excludes that too
    assert rel_l2(got, ref) < 1e-5


@pytest.mark.parametrize("wire_name", ["bf16", "fp8_blockwise_1x32"])
def test_forward_wire_equals_encode_of_forward(wire_name):
    weights, x, pairs = _problem(seed=2)
    wire = combine_wire(wire_name)
    provider = TritonExperts()
    assert torch.equal(provider.forward_wire(x, pairs, weights, MATH, wire), wire.encode(provider.forward(x, pairs, weights, MATH)))


def test_live_rows_write_the_live_pairs_only():
    """Over LiveRows (segments of received rows, live heads only) + SegmentDest: the live pairs' rows equal
    the plain forward's, stale pairs (past a live head) are neither computed nor written; the receiver
    quantises the live bf16 rows only; a second forward on the same scratch allocates nothing."""
    seg_rows, counts, k = 4, (3, 0, 2), 2
    weights, _, _ = _problem(n_exp=4)
    g = torch.Generator().manual_seed(5)
    n = seg_rows * len(counts)
    x = (torch.randn(n, H, generator=g) * 2).to(torch.bfloat16)
    live = torch.zeros(n, dtype=torch.bool)
    for s, c in enumerate(counts):
        live[s * seg_rows: s * seg_rows + c] = True
    x[~live] = float("nan")  # stale rows: anything read from them would poison a live row's neighbours
    slot = torch.randint(0, 4, (n * k,), generator=g)
    pairs = ExpertPairs(torch.arange(n * k) // k, slot, torch.rand(n * k, generator=g), per_row=k)
    live_pairs = live.repeat_interleave(k)
    wire = combine_wire("bf16")
    width = wire.row_bytes(H)
    provider, scratch = TritonExperts(capacity=n * k), ExpertsScratch("cpu")
    plain = provider.forward_wire(x, ExpertPairs(pairs.row, torch.where(live_pairs, slot, -1), pairs.weight), weights,
                                  MATH, wire)
    base = torch.full((n * k, width), 0xAB, dtype=torch.uint8)
    dest = SegmentDest(torch.arange(len(counts)) * seg_rows * k * width, seg_rows * k, width, align=16)
    for i in range(2):
        provider.forward_wire(x, pairs, weights, MATH, wire, out=base, dest=dest, live=LiveRows(torch.tensor(counts), seg_rows),
                              scratch=scratch)
        if i == 0:
            allocated = scratch.allocations
    assert scratch.allocations == allocated
    assert torch.equal(base[live_pairs], plain[live_pairs])
    assert not torch.isnan(wire.decode_fp32(base[live_pairs], H)).any()
    assert (base[~live_pairs] == 0xAB).all()


def test_mismatched_scheme_and_decoder_are_refused():
    weights, x, pairs = _problem()
    with pytest.raises(ValueError, match="quant=fp8_block"):
        TritonExperts().forward(x, pairs, weights, ExpertMath("a8w4"))
    with pytest.raises(ValueError, match="block_fp8"):
        TritonExperts(decoder="split").forward(x, pairs, weights, MATH)
    mx, xm, pm = make_problem("mxfp4", hidden=H, inter=I)
    with pytest.raises(ValueError, match="block-FP8 weights"):
        TritonExperts().forward(xm, pm, mx, MATH)


@pytest.mark.parametrize("wire, combine", [("fp8", "bf16"), ("bf16", "fp8_blockwise_1x32")])
def test_device_forward_carries_fp8_g128_rows(wire, combine):
    """The ep_size-1 device forward (sender quantisation into fp8_g128 rows of the workspace, the Triton experts
    on views of them, the top-k sum) equals the torch forward with the same provider bit for bit, and the layer
    stays inside the scheme's gate against fp32 on the dequantised weights (docs/block-fp8.md)."""
    from megamoe_backend.knobs import Knobs
    from megamoe_backend.layer import MegaMoELayer, fp32_reference_moe
    from megamoe_backend.plan import build_plan
    from megamoe_backend.spec import preset
    from megamoe_backend.workload import ProblemConfig
    from megamoe_backend.workload import make_problem as make_layer_problem

    spec = preset("dsv4-pro").scaled(hidden_size=H, moe_intermediate_size=I, n_routed_experts=8)
    p = make_layer_problem(ProblemConfig(spec, 5, 1, seed=4, masked_fraction=0.2))
    plan = build_plan(spec, Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=16), quant="fp8_block")
    weights = p.expert_weights("fp8_block")
    k = spec.num_experts_per_tok
    device = MegaMoELayer(plan, weights, provider=TritonExperts(capacity=16 * k), device_path=True)
    eager = MegaMoELayer(plan, weights, provider=TritonExperts(capacity=16 * k), device_path=False)
    assert device.workspace is not None
    got = device(p.x, p.topk_ids, p.topk_weights)
    assert torch.equal(got, eager(p.x, p.topk_ids, p.topk_weights))
    w1, w2 = weights.dequantized()
    ref = fp32_reference_moe(p.x, p.topk_ids, p.topk_weights, w1, w2, "plain", spec.swiglu_limit)
    assert rel_l2(got.float(), ref) < 0.06
