"""GPU checks of the Triton block-FP8 experts (decoder block_fp8) at DeepSeek V3 shapes (skipped without CUDA).

Covers what the interpreter cannot: the FP8 tensor cores (their step sums are not exact), Triton's hardware
e4m3 conversion in the quantisers, CUDA-graph capture, and hidden 7168 / intermediate 2048 / top-8 on 32
experts at 8, 128 and 1024 tokens (the decode, mid and prefill tile configs). Gate: relL2 < 0.06 against the
fp32 reference on the dequantised weights (docs/block-fp8.md), and within 2e-2 of the torch experts' exact
math (the FP8 MMA's short sums, FRAG8_TOL's reasoning). The arithmetic itself is pinned bit for bit under the
interpreter: tests/kernels/test_block_fp8_interpreter.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from expert_problems import FRAG8_TOL  # noqa: E402
from megamoe_backend.experts import ExpertMath, ExpertPairs, ExpertWeights  # noqa: E402
from megamoe_backend.experts.live import LiveRows  # noqa: E402
from megamoe_backend.experts.scratch import ExpertsScratch  # noqa: E402
from megamoe_backend.experts.triton.provider import TritonExperts  # noqa: E402
from megamoe_backend.experts.triton.quant import encode_wire_rows, quantize_rows  # noqa: E402
from megamoe_backend.formats.block_fp8 import dequantize_weight_blocks, quantize_groups, quantize_weight_blocks  # noqa: E402
from megamoe_backend.formats.wire import combine_wire, dispatch_wire  # noqa: E402
from megamoe_backend.layer.reference import fp32_reference_moe, rel_l2  # noqa: E402

DEV = torch.device("cuda")
E, H, I, K = 32, 7168, 2048, 8
GATE = 0.06
MATH = ExpertMath("fp8_block", swiglu_limit=None)


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator(device=DEV).manual_seed(0)
    w1q = torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn, device=DEV)
    w2q = torch.empty(E, H, I, dtype=torch.float8_e4m3fn, device=DEV)
    w1s = torch.empty(E, 2 * I // 128, H // 128, device=DEV)
    w2s = torch.empty(E, H // 128, I // 128, device=DEV)
    for e in range(E):
        for q, s, shape, k in ((w1q, w1s, (2 * I, H), H), (w2q, w2s, (H, I), I)):
            qe, se = quantize_weight_blocks(torch.randn(shape, generator=g, device=DEV) / k**0.5)
            q[e].copy_(qe)
            s[e].copy_(se)
    return ExpertWeights(w1q, w2q, "fp8_block", "plain", w1s, w2s)


def _routing(tokens, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(tokens, H, generator=g, device=DEV).to(torch.bfloat16)
    ids = torch.rand(tokens, E, generator=g, device=DEV).topk(K, dim=1).indices
    w = torch.rand(tokens, K, generator=g, device=DEV)
    pairs = ExpertPairs(torch.arange(tokens, device=DEV).repeat_interleave(K), ids.reshape(-1).contiguous(),
                        (w / w.sum(1, keepdim=True)).reshape(-1).contiguous(), per_row=K)
    return x, ids, pairs


def _token_sums(rows, tokens):
    return rows.view(tokens, K, H).sum(1)


def test_group_quantiser_equals_formats_on_the_gpu():
    """Hardware e4m3 conversion and IEEE divisions: formats.quantize_groups bit for bit on finite groups."""
    x = torch.randn(257, 1024, device=DEV) * torch.logspace(-12, 12, 257, device=DEV)[:, None]
    for xx in (x, x.to(torch.bfloat16)):
        ref = quantize_groups(xx)
        got = quantize_rows(xx, "fp8_g128")
        assert torch.equal(got.scales, ref.scales) and torch.equal(got.data, ref.data)
        assert torch.equal(encode_wire_rows(xx, "fp8_g128"), dispatch_wire("fp8", "fp8_g128").encode(xx))


@pytest.mark.parametrize("tokens", [8, 128, 1024])
def test_gate_against_fp32_on_dequantised_weights(weights, tokens):
    x, ids, pairs = _routing(tokens, tokens)
    got = _token_sums(TritonExperts(capacity=tokens * K).forward(x, pairs, weights, MATH), tokens)
    sample = torch.arange(0, tokens, max(1, tokens // 16), device=DEV)  # the fp32 reference of a few tokens
    w1, w2 = dequantize_weight_blocks(weights.w1, weights.w1_scale), dequantize_weight_blocks(weights.w2, weights.w2_scale)
    wts = pairs.weight.view(tokens, K)
    ref = fp32_reference_moe(x[sample].float(), ids[sample], wts[sample], w1, w2, "plain", None)
    err = rel_l2(got[sample], ref)
    print(f"block_fp8 T{tokens}: relL2 vs fp32 on dequantised weights {err:.4f}")
    assert err < GATE
    # against the same quantised math in fp32 (A and A2 fake-quantised): the FP8 MMA's short sums only
    from megamoe_backend.formats import fake_quantize_a

    xs = fake_quantize_a(x[sample].float(), "fp8_g128")
    exact = torch.zeros(len(sample), H, device=DEV)
    for j in range(K):
        for t in range(len(sample)):
            e = int(ids[sample[t], j])
            h = w1[e] @ xs[t]
            act = fake_quantize_a((torch.nn.functional.silu(h[:I]) * h[I:])[None], "fp8_g128")[0]
            exact[t] += wts[sample[t], j] * (w2[e] @ act)
    err_exact = rel_l2(got[sample], exact)
    print(f"block_fp8 T{tokens}: relL2 vs the exact quantised math {err_exact:.2e}")
    assert err_exact < FRAG8_TOL


@pytest.mark.parametrize("tokens", [8, 1024])
def test_graph_replay_equals_eager_and_allocates_nothing(weights, tokens):
    """A forward_wire on a scratch, captured in a CUDA graph: the replay writes what eager wrote, bit for bit,
    with new inputs copied into the captured buffers; the second eager forward allocated nothing."""
    x, _, pairs = _routing(tokens, 7)
    prov, scratch = TritonExperts(capacity=tokens * K), ExpertsScratch(DEV)
    wire = combine_wire("fp8_blockwise_1x32")
    out = torch.empty(tokens * K, wire.row_bytes(H), dtype=torch.uint8, device=DEV)
    a = quantize_rows(x, "fp8_g128")

    def call():
        return prov.forward_wire(a, pairs, weights, MATH, wire, out=out, scratch=scratch)

    call()
    allocated = scratch.allocations
    eager = call().clone()
    assert scratch.allocations == allocated
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        call()
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x2, _, _ = _routing(tokens, 8)  # new tokens through the captured buffers
    a2 = quantize_rows(x2, "fp8_g128")
    a.data.copy_(a2.data)
    a.scales.copy_(a2.scales)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, prov.forward_wire(a2, pairs, weights, MATH, wire))


def test_live_rows_honoured(weights):
    """Over LiveRows (4 segments of 64 rows, a few live at each head): live pairs equal the plain forward of the
    live pairs; stale rows (NaN) are never read; stale pairs are not written."""
    seg_rows, counts = 64, [5, 0, 64, 17]
    n = seg_rows * len(counts)
    x, _, pairs = _routing(n, 11)
    x[torch.arange(n, device=DEV) % seg_rows >= torch.tensor(counts, device=DEV).repeat_interleave(seg_rows)] = float("nan")
    live_rows = (torch.arange(n, device=DEV) % seg_rows) < torch.tensor(counts, device=DEV).repeat_interleave(seg_rows)
    live_pairs = live_rows.repeat_interleave(K)
    prov, scratch = TritonExperts(capacity=n * K), ExpertsScratch(DEV)
    wire = combine_wire("bf16")
    plain = prov.forward_wire(x, ExpertPairs(pairs.row, torch.where(live_pairs, pairs.slot, -1), pairs.weight), weights,
                              MATH, wire)
    out = torch.full((n * K, wire.row_bytes(H)), 0xAB, dtype=torch.uint8, device=DEV)
    live = LiveRows(torch.tensor(counts, device=DEV), seg_rows)
    prov.forward_wire(x, pairs, weights, MATH, wire, out=out, live=live, scratch=scratch)
    torch.cuda.synchronize()
    assert torch.equal(out[live_pairs], plain[live_pairs])
    assert (out[~live_pairs] == 0xAB).all()
