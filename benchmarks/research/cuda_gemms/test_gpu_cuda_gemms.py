"""GPU checks of the sm_90a CUDA frag8 GEMMs (research code: experts.CudaFrag8Experts) against the
Triton GEMMs and the exact reference.

Skipped without an sm_90 GPU. Each case runs the same forward with CudaFrag8Experts and TritonExperts:
same layout contract, same fragments, same FP8 math, so the outputs agree to the epilogue's rounding (A2
re-quantisation after a SwiGLU whose exp differs by an ulp), and both hold the exact-reference tolerance.
The ``cuda_only`` fixture makes the Triton GEMM launches raise, so every CudaFrag8Experts forward here is
shown to have run the CUDA kernels (no fallback can pass for them).

    PYTHONPATH=.:benchmarks/research python3 -m pytest benchmarks/research/cuda_gemms -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "kernels"))  # expert_problems

pytest.importorskip("triton")
if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from megamoe_backend.experts import ExpertMath, ExpertPairs, TorchReferenceExperts  # noqa: E402
from megamoe_backend.experts.live import SegmentDest  # noqa: E402
from megamoe_backend.experts.triton import provider as provider_module  # noqa: E402
from megamoe_backend.experts.triton.provider import TritonExperts  # noqa: E402
from megamoe_backend.experts.triton.quant import quantize_rows  # noqa: E402
from megamoe_backend.formats.wire import combine_wire  # noqa: E402
from expert_problems import FRAG8_TOL, make_problem  # noqa: E402
from megamoe_backend.layer.reference import rel_l2  # noqa: E402

from cuda_gemms.experts import CudaFrag8Experts  # noqa: E402
from cuda_gemms.gemms import Sm90Frag8Gemms  # noqa: E402

DEV = torch.device("cuda")
CROSS_TOL = 2e-3  # CUDA vs Triton GEMMs: equal products and accumulation, A2 rounding flips only


def _problem(counts, quant, hidden=512, inter=256, masked=0.0, seed=0):
    """Pairs with ``counts`` rows per local expert (0: empty expert), a fraction ``masked`` at slot -1."""
    p = sum(counts)
    weights, x, _ = make_problem("mxfp4", n_exp=len(counts), hidden=hidden, inter=inter, tokens=p, topk=1, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    slot = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])[torch.randperm(p, generator=g)]
    if masked:
        slot[torch.rand(p, generator=g) < masked] = -1
    pairs = ExpertPairs(torch.arange(p).to(DEV), slot.to(DEV), torch.rand(p, generator=g).to(DEV))
    math = ExpertMath(quant, 10.0)
    a = quantize_rows(x.to(DEV), math.a_format)
    prepared = TritonExperts().prepare_weights(weights.to(DEV), math)
    assert prepared.storage == "fragments_fp8"
    return a, pairs, prepared, weights.to(DEV), math


@pytest.fixture
def cuda_only(monkeypatch):
    """The Triton GEMM launches raise while a test body runs CudaFrag8Experts: what ran was the CUDA GEMMs.
    Returns the real Triton provider's forward, for the comparisons (run outside the patch)."""
    real = {n: getattr(provider_module, n) for n in ("gemm1", "gemm2")}

    def refused(*_a, **_k):
        raise AssertionError("a Triton GEMM launch ran inside a CudaFrag8Experts forward")

    def triton(method, *args, **kw):
        with monkeypatch.context() as m:
            for n, f in real.items():
                m.setattr(provider_module, n, f)
            return getattr(TritonExperts(), method)(*args, **kw)

    for n in real:
        monkeypatch.setattr(provider_module, n, refused)
    return triton


def test_kernels_build_and_load():
    got = Sm90Frag8Gemms.for_device(DEV)
    assert not isinstance(got, str), got
    print(f"cubin {got.build.cubin.name}: compiled here {got.build.compiled}, {got.build.seconds:.1f} s")


@pytest.mark.parametrize("quant", ["a8w4", "a4w4"])
@pytest.mark.parametrize("counts,masked", [
    ((0, 128, 300, 17, 0, 64), 0.0),      # empty experts, a full tile, 2 full + a 44-row tile, 17- and 64-row tiles
    ((256, 1, 129, 40, 96, 16), 0.3),     # 30 % of the pairs at slot -1 (not routed here)
])
def test_cuda_equals_triton(counts, masked, quant, cuda_only):
    a, pairs, w, w_rowmajor, math = _problem(counts, quant, masked=masked)
    here = pairs.slot >= 0
    cuda = CudaFrag8Experts().forward(a, pairs, w, math)
    tri = cuda_only("forward", a, pairs, w, math)
    ref = TorchReferenceExperts().forward(a, pairs, w_rowmajor, math)
    assert torch.isfinite(cuda[here]).all()
    assert rel_l2(cuda[here], tri[here]) < CROSS_TOL
    assert rel_l2(cuda[here], ref[here]) < FRAG8_TOL
    # deterministic, and the wire rows GEMM2 writes are the encode of its fp32 rows, bit for bit
    assert torch.equal(cuda[here], CudaFrag8Experts().forward(a, pairs, w, math)[here])
    for name in ("bf16", "fp8_blockwise_1x32"):
        wire = combine_wire(name)
        rows = CudaFrag8Experts().forward_wire(a, pairs, w, math, wire)
        assert torch.equal(rows[here], wire.encode(cuda)[here]), name


def test_graph_capture_follows_routing(cuda_only):
    a, pairs, w, _, math = _problem((100, 60, 0, 140), "a8w4")
    prov = CudaFrag8Experts(capacity=len(pairs))
    wire = combine_wire("bf16")
    eager = prov.forward_wire(a, pairs, w, math, wire).clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        prov.forward_wire(a, pairs, w, math, wire)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = prov.forward_wire(a, pairs, w, math, wire)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    pairs.slot.copy_(torch.flip(pairs.slot, [0]))  # new routing, same sizes: the replay follows it
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, prov.forward_wire(a, pairs, w, math, wire))
    assert not torch.equal(captured, eager)


@pytest.mark.parametrize("wire_name", ["bf16", "fp8_blockwise_1x32"])
def test_destination_table_and_segments(wire_name, cuda_only):
    """Rows through a destination table (DEST 1) and per segment (DEST 2) into a second buffer, at 16-byte
    aligned and unaligned offsets, equal the rows written in pair order."""
    a, pairs, w, _, math = _problem((70, 0, 90, 33), "a8w4", masked=0.3)
    wire = combine_wire(wire_name)
    row_bytes = wire.row_bytes(w.hidden)
    here = pairs.slot >= 0
    plain = CudaFrag8Experts().forward_wire(a, pairs, w, math, wire)
    p = len(pairs)
    for shift in (0, 8):
        perm = torch.randperm(p, device=DEV)
        stride = row_bytes + 64
        big = torch.zeros(shift + p * stride + 64, dtype=torch.uint8, device=DEV)
        dest = (shift + perm * stride).to(torch.int64)
        CudaFrag8Experts().forward_wire(a, pairs, w, math, wire, out=big, dest=dest)
        got = big[shift:shift + p * stride].view(p, stride)[perm][:, :row_bytes]  # pair i at slot perm[i]
        assert torch.equal(got[here], plain[here]), f"table, shift {shift}"
        seg_pairs = p - p // 2
        second_at = shift + seg_pairs * stride + 32
        seg = SegmentDest(torch.tensor([shift, second_at], dtype=torch.int64, device=DEV), seg_pairs, stride)
        big.zero_()
        CudaFrag8Experts().forward_wire(a, pairs, w, math, wire, out=big, dest=seg)
        first = big[shift:shift + seg_pairs * stride].view(-1, stride)[:, :row_bytes]
        second = big[second_at:second_at + (p // 2) * stride].view(-1, stride)[:, :row_bytes]
        rows = torch.cat([first, second[: p - len(first)]])
        assert torch.equal(rows[here], plain[here]), f"segments, shift {shift}"


@pytest.mark.parametrize("quant", ["a8w4", "a4w4"])
def test_dsv4_pro_shapes_cuda(quant, cuda_only):
    """hidden 7168 / intermediate 3072, top-6 over 8 experts: the exact reference's tolerance, Triton's result."""
    weights, x, pairs = make_problem("mxfp4", n_exp=8, hidden=7168, inter=3072, tokens=64, topk=6, seed=1)
    wd = weights.to(DEV)
    pd = ExpertPairs(pairs.row.to(DEV), pairs.slot.to(DEV), pairs.weight.to(DEV))
    math = ExpertMath(quant, 10.0)
    a = quantize_rows(x.to(DEV), math.a_format)
    prepared = TritonExperts().prepare_weights(wd, math)
    cuda = CudaFrag8Experts().forward(a, pd, prepared, math)
    tri = cuda_only("forward", a, pd, prepared, math)
    ref = TorchReferenceExperts().forward(a, pd, wd, math)
    print(f"{quant}: cuda vs exact {rel_l2(cuda, ref):.2e}, vs triton {rel_l2(cuda, tri):.2e}")
    assert rel_l2(cuda, ref) < FRAG8_TOL
    assert rel_l2(cuda, tri) < CROSS_TOL


def test_where_the_kernels_cannot_run_it_raises_instead_of_falling_back():
    """hidden 384 is not whole 256-row weight tiles: a clear error, never the Triton GEMMs under this name."""
    a, pairs, w, _, math = _problem((20, 20), "a8w4", hidden=384, inter=128)
    with pytest.raises(RuntimeError, match="whole 256-row weight tiles"):
        CudaFrag8Experts().forward(a, pairs, w, math)
