"""GPU checks of the Triton experts (skipped without CUDA; run on the H200 device machine).

Covers what the interpreter cannot: the tl.dot_scaled decoder, real fp8/bf16 casts, CUDA-graph
capture of a whole forward, and DeepSeek-V4-Pro shapes (hidden 7168, intermediate 3072).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from megamoe_backend.experts import ExpertMath, ExpertPairs, TorchReferenceExperts  # noqa: E402
from megamoe_backend.experts.triton.provider import TritonExperts  # noqa: E402
from megamoe_backend.experts.triton.quant import encode_wire_rows, quantize_rows  # noqa: E402
from megamoe_backend.formats import MXTensor, dequantize_mx, quantize_mx  # noqa: E402
from megamoe_backend.formats.wire import encode_mx_rows  # noqa: E402
from expert_problems import FRAG8_TOL, make_problem  # noqa: E402
from megamoe_backend.layer.reference import rel_l2  # noqa: E402

DEV = torch.device("cuda")
SCHEMES = [("a8w4", "mxfp4"), ("a4w4", "mxfp4"), ("bf16", "mxfp4"), ("bf16", "bf16"), ("a8w4", "bf16")]


def _to(dev, weights, x, pairs):
    return weights.to(dev), x.to(dev), ExpertPairs(pairs.row.to(dev), pairs.slot.to(dev), pairs.weight.to(dev))


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_quant_bit_identical_gpu(fmt):
    """Scales everywhere and payload bytes of every finite block equal formats.quantize_mx.

    Payload bytes inside a NaN-scale block are don't-care (they dequantise to NaN whatever they
    are) and platform-dependent even for torch itself (NaN sign conventions of x86 vs CUDA, fp8
    overflow rules across torch releases), so there only the NaN dequantisation is checked.
    """
    x = torch.randn(257, 1024) * torch.logspace(-20, 20, 257)[:, None]
    x[3, 5] = float("nan")
    x[7, 100] = float("-inf")
    per = 32 if fmt == "fp8" else 16  # payload bytes per 1x32 block
    for xx in (x, x.to(torch.bfloat16)):
        ref = quantize_mx(xx, fmt)
        got = quantize_rows(xx.to(DEV), fmt)
        got_data, got_scales = got.data.cpu(), got.scales.cpu()
        assert torch.equal(got_scales, ref.scales)
        finite = (ref.scales != 0xFF).repeat_interleave(per, dim=1)
        bad = ((got_data != ref.data) & finite).nonzero()
        for row, col in bad[:4].tolist():  # diagnostics for the device log
            print(f"{fmt} {xx.dtype} data[{row},{col}] got {int(got_data[row, col])} want {int(ref.data[row, col])}")
        assert len(bad) == 0
        assert torch.isnan(dequantize_mx(MXTensor(got_data, got_scales, fmt))[~finite.repeat_interleave(32 // per, dim=1)]).all()
        assert torch.equal(encode_wire_rows(xx.to(DEV), fmt).cpu()[:, : got_data.shape[1]][finite], encode_mx_rows(ref)[:, : got_data.shape[1]][finite])


@pytest.mark.parametrize("p,e,bm", [(48, 192, 16), (768, 192, 16), (6144, 192, 64), (49152, 192, 128), (49152, 384, 16)])
def test_layout_triton_equals_torch_gpu(p, e, bm):
    """The Triton layout build at serving sizes (8..8192 tokens x top-6) equals the torch build."""
    from megamoe_backend.experts.triton.layout import build_layout, build_layout_torch

    g = torch.Generator(device=DEV).manual_seed(p)
    slot = torch.randint(0, e, (p,), device=DEV, generator=g)
    row = torch.randint(0, p // 6, (p,), device=DEV, generator=g)  # received rows of the pairs
    got, ref = build_layout(slot, e, bm, row=row), build_layout_torch(slot, e, bm, row)
    assert torch.equal(got.tile_expert, ref.tile_expert) and torch.equal(got.sorted_pair, ref.sorted_pair)
    assert torch.equal(got.sorted_row, ref.sorted_row)


@pytest.mark.parametrize("counts,e,seg_rows", [((5, 0, 3, 1, 0, 2, 7, 4), 48, 8192), ((4400,) * 8, 48, 8192),
                                               ((8192, 3000, 0, 8192, 6500, 1, 8192, 4096), 192, 8192),
                                               ((24, 17, 0, 24), 4, 64), ((64, 64), 8, 64)])
def test_layout_over_live_rows_equals_torch_gpu(counts, e, seg_rows):
    """Over an EP region (8 segments x 8192 rows x top-6 slots, stale slots past each live head) the
    layout equals the torch build of the live pairs. The large cases give each of the fixed grid's
    programs a span of several chunks (~1,650 and ~1,790 chunks over LIVE_CHUNK_PROGRAMS = 264)."""
    from megamoe_backend.experts.live import LiveRows
    from megamoe_backend.experts.triton.layout import build_layout, build_layout_torch

    k, bm = 6, 128 if seg_rows > 64 else 16
    g = torch.Generator(device=DEV).manual_seed(sum(counts))
    slot = torch.randint(-1, e, (len(counts) * seg_rows * k,), device=DEV, generator=g)  # -1: owned by another rank
    live = torch.zeros_like(slot, dtype=torch.bool)
    for s, c in enumerate(counts):
        live[s * seg_rows * k: (s * seg_rows + c) * k] = True
    row = torch.arange(slot.numel(), device=DEV) // k
    ref = build_layout_torch(torch.where(live, slot, -1), e, bm, row)
    got = build_layout(slot, e, bm, row=row, live=LiveRows(torch.tensor(counts, device=DEV), seg_rows))
    n = int(got.live_tiles[0])
    assert n == int((ref.tile_expert >= 0).sum())
    assert torch.equal(got.tile_expert[:n], ref.tile_expert[:n])
    assert torch.equal(got.sorted_pair[: n * bm], ref.sorted_pair[: n * bm])
    assert torch.equal(got.sorted_row[: n * bm], ref.sorted_row[: n * bm])



# "frag" (the GPU default for prepared MXFP4 weights) and "split" (row-major weights) on every scheme
# and layout; the other decoders on a few (they compile slowly and are covered on every scheme by the
# interpreter tests).
CASES = [("frag", q, w, lay, lim) for q, w in SCHEMES if w == "mxfp4" for lay, lim in (("interleaved", 10.0), ("plain", None))]
CASES += [("frag8", q, "mxfp4", lay, lim) for q in ("a8w4", "a4w4") for lay, lim in (("interleaved", 10.0), ("plain", None))]
CASES += [("split", q, w, lay, lim) for q, w in SCHEMES for lay, lim in (("interleaved", 10.0), ("plain", None))]
CASES += [("dot_scaled", "a8w4", "mxfp4", "plain", 10.0), ("dot_scaled", "a4w4", "mxfp4", "interleaved", None)]
CASES += [("manual", "a8w4", "mxfp4", "interleaved", 10.0)]


@pytest.mark.parametrize("decoder,quant,wfmt,layout,limit", CASES)
def test_small_matches_reference(decoder, quant, wfmt, layout, limit):
    inter = 256 if decoder == "frag8" else 192  # frag8 needs K % 128 (fragments.fp8_k_order); the others keep 192
    weights, x, pairs = make_problem(wfmt, layout, n_exp=6, hidden=256, inter=inter, tokens=40, topk=3)
    math = ExpertMath(quant, limit)
    a = x if math.a_format is None else quantize_mx(x, math.a_format)
    ref = TorchReferenceExperts().forward(a, pairs, weights, math)
    wd, xd, pd = _to(DEV, weights, x, pairs)
    ad = xd if math.a_format is None else quantize_rows(xd, math.a_format)
    out = torch.full((len(pairs), 256), float("nan"), device=DEV)
    prov = TritonExperts(decoder=decoder)
    wd = prov.prepare_weights(wd, math)
    assert wd.storage == {"frag": "fragments", "frag8": "fragments_fp8"}.get(decoder, "rowmajor")
    prov.forward(ad, pd, wd, math, out=out)
    assert torch.isfinite(out).all(), "some output element was never written"
    # MX paths: products are exact, only fp32 summation order differs; A2 rounding can flip rarely.
    # frag8: the FP8 tensor cores add their products with fewer bits than fp32 (measured 2.0e-3 here).
    assert rel_l2(out.cpu(), ref) < (FRAG8_TOL if decoder == "frag8" else 2e-3)


def test_graph_capture_and_capacity():
    weights, x, pairs = make_problem("mxfp4", n_exp=8, hidden=256, inter=128, tokens=32, topk=4)
    wd, xd, pd = _to(DEV, weights, x, pairs)
    math = ExpertMath("a8w4", 10.0)
    a = quantize_rows(xd, "fp8")
    prov = TritonExperts(capacity=len(pairs))
    wd = prov.prepare_weights(wd, math)
    assert wd.storage == "fragments_fp8"  # auto, MX activations: frag8
    eager = prov.forward(a, pd, wd, math)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        prov.forward(a, pd, wd, math)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        captured = prov.forward(a, pd, wd, math)
    pd.slot.copy_(torch.flip(pd.slot, [0]))  # new routing, same sizes: replay must follow it
    g.replay()
    torch.cuda.synchronize()
    assert rel_l2(captured, prov.forward(a, pd, wd, math)) < 1e-6
    assert not torch.equal(captured, eager)
    with pytest.raises(ValueError, match="capacity"):
        TritonExperts(capacity=len(pairs) - 1).forward(a, pd, wd, math)


@pytest.mark.parametrize("counts", [(130, 100, 140, 30), (40, 20, 64, 60)])
@pytest.mark.parametrize("quant", ["a8w4", "bf16"])
def test_short_tiles_gpu(counts, quant):
    """The bucket defaults' tail_m (short last tiles) on the GPU: rows per expert chosen so the
    prefill (BM 128, tail 16) and mid (BM 64, tail 32) buckets see short, full and long-partial tiles."""
    from megamoe_backend.experts.triton.config import default_config
    from megamoe_backend.experts.triton.layout import build_layout

    p = sum(counts)
    weights, x, _ = make_problem("mxfp4", n_exp=4, hidden=1024, inter=512, tokens=p, topk=1, seed=2)
    g = torch.Generator().manual_seed(5)
    slot = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])[torch.randperm(p, generator=g)]
    pairs = ExpertPairs(torch.arange(p), slot, torch.rand(p, generator=g))
    wd, xd, pd = _to(DEV, weights, x, pairs)
    math = ExpertMath(quant, 10.0)
    a = xd if math.a_format is None else quantize_rows(xd, math.a_format)
    prov = TritonExperts()
    prepared = prov.prepare_weights(wd, math)
    mode = prov.resolve_decoder(prepared.fmt, prepared.storage)
    cfg = default_config(p, 4, mode)
    if mode == "frag8":
        assert cfg.tail_m > 0
        lay = build_layout(pd.slot, 4, cfg.block_m)
        rows = lay.sorted_pair.view(-1, cfg.block_m)[(lay.tile_expert >= 0)]
        assert (rows[:, cfg.tail_m] < 0).any() and (rows[:, cfg.tail_m] >= 0).any()
    out = prov.forward(a, pd, prepared, math)
    ref = TorchReferenceExperts().forward(a, pd, wd, math)
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) < (FRAG8_TOL if mode == "frag8" else 2e-3)
    if cfg.tail_m:  # deterministic, and bit for bit the full-height result (benchmarks/research/check_short_tiles.py)
        plain = TritonExperts(config=cfg.with_(tail_m=0, tail_ride=False)).forward(a, pd, prepared, math)
        assert torch.equal(out, prov.forward(a, pd, prepared, math)) and torch.equal(out, plain)
        # short tiles riding in their expert's previous tile, or in a launch of their own: the same bits
        flipped = TritonExperts(config=cfg.with_(tail_ride=not cfg.tail_ride)).forward(a, pd, prepared, math)
        assert torch.equal(out, flipped)
    _assert_wire_rows_equal_encode(prov, a, pd, prepared, math, out)


def _assert_wire_rows_equal_encode(prov, a, pairs, weights, math, out):
    """forward_wire (GEMM2 writes the combine wire row) == WireFormat.encode of the fp32 rows, bit for bit."""
    from megamoe_backend.formats.wire import combine_wire

    for name in ("bf16", "fp8_blockwise_1x32"):
        wire = combine_wire(name)
        assert torch.equal(prov.forward_wire(a, pairs, weights, math, wire), wire.encode(out)), name


DSV4_CASES = [(q, d) for q in ("a8w4", "a4w4", "bf16") for d in ("auto", "frag", "split")]


@pytest.mark.parametrize("quant,decoder", DSV4_CASES)
def test_dsv4_pro_shapes(quant, decoder):
    """8 experts at hidden 7168 / intermediate 3072; the exact-math reference in fp64 on the GPU.
    auto + prepare_weights = frag8 for MX activations (FP8 MMA: the tensor core adds products with
    fewer bits than fp32, and A is re-expressed over one scale per row), frag for bf16 ones; frag on
    every scheme; split reads row-major weights."""
    weights, x, pairs = make_problem("mxfp4", n_exp=8, hidden=7168, inter=3072, tokens=64, topk=6, seed=1)
    wd, xd, pd = _to(DEV, weights, x, pairs)
    math = ExpertMath(quant, 10.0)
    a = xd if math.a_format is None else quantize_rows(xd, math.a_format)
    prov = TritonExperts(decoder=decoder)
    prepared = prov.prepare_weights(wd, math)
    out = prov.forward(a, pd, prepared, math)
    ref = TorchReferenceExperts().forward(a, pd, wd, math)
    frag8 = prepared.storage == "fragments_fp8"
    assert frag8 == (decoder == "auto" and quant != "bf16")
    assert rel_l2(out, ref) < (FRAG8_TOL if frag8 else 2e-3)
    print(f"{prepared.storage} {quant}: relL2 vs exact reference {rel_l2(out, ref):.2e}")
    _assert_wire_rows_equal_encode(prov, a, pd, prepared, math, out)
