"""Triton expert kernels under the Triton interpreter (TRITON_INTERPRET=1), on CPU, small shapes.

Checked here against the torch formats / TorchReferenceExperts: the MX quantisation kernel (bit-exact
bytes, wire rows), the sync-free expert layout, GEMM1 + SwiGLU (+ limit) + A2 re-quantisation and
GEMM2 x route weight for the "frag", "frag8", "split" and "manual" decoders, gate/up interleaved and
plain, bf16 and MXFP4 weights (row-major and fragment storage), bf16 / fp8 / fp4 A operands, NaN
isolation, bad-input errors, and a bench smoke run.

What the interpreter cannot run (covered by tests/kernels/test_gpu_experts.py on the H200):
- the "dot_scaled" decoder: the interpreter has no tl.dot_scaled;
- the PTX e2m1 decodes of the "split", "frag" and "frag8" decoders (tl.inline_asm_elementwise is not
  interpreted): the interpreter runs the same data flow with the portable decodes (USE_ASM=False in
  mxjit.decode_fp4_split / decode_fp4_frag / decode_fp4_frag8), which produce identical values; the
  PTX bit tricks themselves are emulated in torch by tests/core/test_fragments.py;
- bf16 / fp8 tensor-core MMA (the interpreter's bf16 dot is broken, so kernels widen to fp32 there:
  F32_DOT), CUDA-graph capture, register/shared-memory limits and all timing.
These tests skip on machines with CUDA (the GPU module covers them there, without the interpreter).
"""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/kernels/test_gpu_experts.py covers CUDA", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # normally already set by tests/kernels/conftest.py
pytest.importorskip("triton")


def interpreter_active() -> bool:
    """False when Triton was imported in compiled mode earlier in this process (see conftest.py)."""
    import triton.language.standard as std

    return type(std._elementwise_max).__name__ == "InterpretedFunction"


if not interpreter_active():
    pytest.skip("Triton was imported before TRITON_INTERPRET=1; test_triton_interpreter_isolated.py runs this "
                "module in a fresh process", allow_module_level=True)

from megamoe_backend.experts import (  # noqa: E402
    ExpertMath,
    ExpertPairs,
    ExpertWeights,
    TorchReferenceExperts,
    quantize_expert_weights,
)
from megamoe_backend.experts.fragments import fp8_k_order  # noqa: E402
from megamoe_backend.formats import MXTensor, dequantize_mx, quantize_mx  # noqa: E402
from megamoe_backend.formats.wire import encode_mx_rows  # noqa: E402
from expert_problems import make_problem  # noqa: E402
from megamoe_backend.layer.reference import rel_l2  # noqa: E402

_MODULES = ("mxjit", "quant", "mainloop", "gather", "layout_kernels", "layout", "config", "gemm1", "gemm2", "provider")


def _kernels():
    """The kernel modules, (re)imported so that their @triton.jit functions are interpreted.

    triton.jit decides at decoration time; if another test imported these modules before
    TRITON_INTERPRET was set, reload them in dependency order.
    """
    from triton.runtime.interpreter import InterpretedFunction

    mods = {n: importlib.import_module(f"megamoe_backend.experts.triton.{n}") for n in _MODULES}
    if not isinstance(mods["quant"]._quantize_rows_kernel, InterpretedFunction):
        for n in _MODULES:
            mods[n] = importlib.reload(mods[n])
    return mods


K = _kernels()


# ------------------------------------------------------------------------------------ quantisation
def _edge_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 128, generator=g) * torch.tensor([1e-30, 1e-3, 1.0, 7.0, 1e4, 1e30])[:, None]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, 1.0625, 1.1875, 0.0, -0.0, 2**-8, 3 * 2**-10])
    x[2, :32] = torch.cat((ties, ties * 448 / 6))
    x[3, 32:64] = 0.0
    x[3, 96:128] = 0.0
    x[3, 100] = 2.8e-44  # fp32 subnormal whose amax / max_pos underflows to 0 (hypothesis found it): smallest scale
    x[4, 64:68] = torch.tensor([6 * 2**-127 * (1 + 2**-23), 448 * 2**-127 * (1 + 2**-23), 1.5 * 2**-125, 1.75 * 2**-119])
    x[4, 68:96] = 0.0
    x[1, 5] = float("nan")
    x[5, 100] = float("-inf")
    return x


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_matches_formats(fmt, dtype):
    x = _edge_rows().to(dtype)
    ref = quantize_mx(x, fmt)
    got = K["quant"].quantize_rows(x, fmt)
    assert torch.equal(got.scales, ref.scales)
    # Bytes inside a NaN-scale block are don't-care (they dequantise to NaN) and platform-dependent.
    per = 32 if fmt == "fp8" else 16
    finite = (ref.scales != 0xFF).repeat_interleave(per, dim=1)
    assert torch.equal(got.data[finite], ref.data[finite])
    nan_elems = ~finite.repeat_interleave(32 // per, dim=1)
    assert nan_elems.any() and torch.isnan(dequantize_mx(got)[nan_elems]).all()
    wire = K["quant"].encode_wire_rows(x, fmt)
    assert torch.equal(wire[:, got.data.shape[1]:], ref.scales)
    assert torch.equal(wire[:, : got.data.shape[1]][finite], encode_mx_rows(ref)[:, : got.data.shape[1]][finite])


def test_e4m3_rounding_every_code():
    """Every e4m3 value and every midpoint between neighbours (block amax 448 -> scale 1)."""
    codes = torch.arange(0, 127, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    mids = (vals[:-1] + vals[1:]) / 2
    probe = torch.cat((vals, mids, -vals, -mids, mids * (1 + 2**-20), mids * (1 - 2**-20)))
    probe = probe[: probe.numel() // 31 * 31].reshape(-1, 31)
    x = torch.cat((torch.full((probe.shape[0], 1), 448.0), probe), dim=1)
    got = K["quant"].quantize_rows(x, "fp8")
    ref = quantize_mx(x, "fp8")
    assert torch.equal(got.scales, ref.scales) and torch.equal(got.data, ref.data)


def test_wire_rows_into_preallocated_buffer():
    x = torch.randn(3, 64).to(torch.bfloat16)
    buf = torch.full((4, 80), 7, dtype=torch.uint8)
    K["quant"].encode_wire_rows(x, "fp4", out=buf)
    assert torch.equal(buf[:3, :34], encode_mx_rows(quantize_mx(x, "fp4")))
    assert (buf[3] == 7).all() and (buf[:3, 34:] == 7).all()
    with pytest.raises(ValueError, match="wire out buffer"):
        K["quant"].encode_wire_rows(x, "fp4", out=torch.empty(3, 10, dtype=torch.uint8))


def test_quantize_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of the MX block"):
        K["quant"].quantize_rows(torch.randn(2, 48), "fp8")
    with pytest.raises(ValueError, match="contiguous along K"):
        K["quant"].quantize_rows(torch.randn(64, 2).T, "fp8")
    with pytest.raises(ValueError, match="unknown A format 'fp6'; expected 'fp8', 'fp4' \\(MX\\) or 'fp8_g128'"):
        K["quant"].quantize_rows(torch.randn(2, 64), "fp6")
    with pytest.raises(ValueError, match="multiple of the fp8_g128 group"):
        K["quant"].quantize_rows(torch.randn(2, 64), "fp8_g128")


# ------------------------------------------------------------------------------------------ layout
def test_layout_sorted_padded_and_static():
    g = torch.Generator().manual_seed(1)
    slot = torch.randint(0, 5, (37,), generator=g)
    lay = K["layout"].build_layout(slot, num_experts=5, block_m=4, capacity=40)
    assert lay.num_tiles == K["layout"].max_tiles(37, 5, 4)  # static: from sizes only
    sp = lay.sorted_pair.view(lay.num_tiles, 4)
    seen = sp[sp >= 0].sort().values
    assert torch.equal(seen, torch.arange(37, dtype=torch.int32))
    for t in range(lay.num_tiles):
        e = int(lay.tile_expert[t])
        members = sp[t][sp[t] >= 0].long()
        if e < 0:
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and (slot[members] == e).all()
    # within an expert the original pair order is kept (stable), padding only at each expert's end
    for e in range(5):
        rows = sp[lay.tile_expert == e].reshape(-1)
        real = rows[rows >= 0]
        assert torch.equal(real, torch.nonzero(slot == e).squeeze(1).to(torch.int32))
        assert (rows[real.numel():] == -1).all()


@pytest.mark.parametrize("p,e,bm", [(0, 3, 16), (1, 1, 16), (300, 7, 16), (1000, 192, 16), (513, 200, 64), (2000, 384, 32),
                                    (300, 200, 64)])
def test_layout_triton_build_equals_torch_reference(p, e, bm):
    """The three-launch Triton build (chunked counting sort) gives the torch build's layout exactly,
    across chunk boundaries (128 pairs), experts with no pairs, E not a power of two and P = 0; the
    last case makes each histogram program fill several 1024-row blocks of padding."""
    g = torch.Generator().manual_seed(p)
    slot = torch.randint(0, e, (p,), generator=g)
    row = torch.randint(0, max(1, p // 3), (p,), generator=g)  # received rows, shared by several pairs
    got = K["layout"].build_layout(slot, e, bm, row=row)  # interpreter: the Triton path
    ref = K["layout"].build_layout_torch(slot, e, bm, row)
    assert got.num_tiles == ref.num_tiles
    assert torch.equal(got.tile_expert, ref.tile_expert)
    assert torch.equal(got.sorted_pair, ref.sorted_pair)
    assert torch.equal(got.sorted_row, ref.sorted_row)
    sp = ref.sorted_pair.long()
    by_definition = torch.full_like(ref.sorted_row, -1)
    by_definition[sp >= 0] = row[sp[sp >= 0]].to(torch.int32)
    assert torch.equal(ref.sorted_row, by_definition)
    assert torch.equal(K["layout"].build_layout(slot, e, bm).sorted_row, ref.sorted_pair)  # default: the pair index


def test_layout_triton_build_ignores_out_of_range_slots():
    """Device slots are validated by the layer (a CPU tensor raises below); the kernels themselves
    must never index out of bounds on a bad one: that pair simply gets no row."""
    slot = torch.tensor([0, 2, 7, 1, -3, 2, 0])
    tile_expert, sorted_pair, sorted_row, _ = K["layout_kernels"].build_layout_triton(slot, torch.full_like(slot, 5), 3, 4,
                                                                                   K["layout"].max_tiles(7, 3, 4))
    assert torch.equal(sorted_row, torch.where(sorted_pair >= 0, 5, -1).to(torch.int32))
    ref = K["layout"].build_layout_torch(torch.tensor([0, 2, 1, 2, 0]), 3, 4)
    keep = torch.tensor([0, 1, 3, 5, 6], dtype=torch.int32)  # the in-range pairs, renumbered like ref
    got = torch.where(sorted_pair >= 0, sorted_pair, -1)
    placed = got[got >= 0]
    assert sorted(placed.tolist()) == keep.tolist()
    assert torch.equal(tile_expert[: ref.num_tiles], ref.tile_expert)
    mapped = torch.where(got >= 0, torch.searchsorted(keep, got.clamp(min=0)).to(torch.int32), -1)
    assert torch.equal(mapped[: ref.sorted_pair.numel()], ref.sorted_pair)


def test_layout_capacity_and_range_errors():
    with pytest.raises(ValueError, match="capacity"):
        K["layout"].build_layout(torch.zeros(9, dtype=torch.int64), 2, 4, capacity=8)
    with pytest.raises(ValueError, match="out of range"):
        K["layout"].build_layout(torch.tensor([0, 3]), 2, 4)
    with pytest.raises(ValueError, match=r"pairs.row must be \[P\] = \[2\]"):
        K["layout"].build_layout(torch.tensor([0, 1]), 2, 4, row=torch.tensor([0, 1, 2]))


# ----------------------------------------------------------------------------------------- experts
_problem = make_problem
_rel = rel_l2


FRAG8_SHAPE = {"frag8": dict(hidden=128, inter=128)}  # frag8 needs K % 128 == 0 (fragments.fp8_k_order)
CASES = [
    ("frag", "a8w4", "mxfp4", "interleaved", 10.0),
    ("frag", "a4w4", "mxfp4", "plain", None),
    ("frag", "bf16", "mxfp4", "interleaved", 1.0),
    ("frag8", "a8w4", "mxfp4", "plain", 10.0),
    ("frag8", "a4w4", "mxfp4", "interleaved", None),
    ("split", "a8w4", "mxfp4", "interleaved", 10.0),
    ("split", "a4w4", "mxfp4", "plain", None),
    ("split", "bf16", "mxfp4", "interleaved", 1.0),
    ("split", "bf16", "bf16", "plain", None),
    ("manual", "a8w4", "mxfp4", "plain", None),
    ("manual", "a4w4", "mxfp4", "interleaved", 10.0),
]


@pytest.mark.parametrize("decoder,quant,wfmt,layout,limit", CASES)
def test_experts_match_reference(decoder, quant, wfmt, layout, limit):
    weights, x, pairs = _problem(wfmt, layout, **FRAG8_SHAPE.get(decoder, {}))
    math = ExpertMath(quant, limit)
    a = x if math.a_format is None else quantize_mx(x, math.a_format)
    ref = TorchReferenceExperts().forward(a, pairs, weights, math)
    out = torch.full((len(pairs), weights.hidden), float("nan"))
    prov = K["provider"].TritonExperts(decoder=decoder)
    used = prov.prepare_weights(weights, math)  # fragment storage for frag / frag8, unchanged otherwise
    assert used.storage == {"frag": "fragments", "frag8": "fragments_fp8"}.get(decoder, "rowmajor")
    prov.forward(a, pairs, used, math, out=out)
    assert torch.isfinite(out).all(), "an output element was never written"
    # Products are exact in every decoder; only fp32 summation order differs from the fp64 reference.
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("decoder,quant,hidden,inter", [("frag8", "a8w4", 384, 384), ("frag", "bf16", 192, 192)])
def test_weight_tiles_past_the_last_row_match_reference(decoder, quant, hidden, inter):
    """The fragment loops drop the weight rows' load mask when the tiles divide N (W_FULL: the DeepSeek
    shapes and every other test here); this runs the masked loop, where the last tile reaches past N:
    GEMM1's N = 2 x inter and GEMM2's N = hidden are not multiples of block_n1 / block_n2 here. (Rows
    past N only feed output columns that are never stored, so what the mask guards is memory safety,
    which the interpreter does not check.)"""
    cfg = K["config"].TileConfig(block_m=16, block_n1=512 if decoder == "frag8" else 256, block_n2=256 if decoder == "frag8" else 128,
                                 block_k=128 if decoder == "frag8" else 64, num_warps=4, num_stages=1, group_m=2)
    assert (2 * inter) % cfg.block_n1 and hidden % cfg.block_n2
    weights, x, pairs = _problem("mxfp4", hidden=hidden, inter=inter, tokens=5)
    math = ExpertMath(quant, 10.0)
    a = x if math.a_format is None else quantize_mx(x, math.a_format)
    ref = TorchReferenceExperts().forward(a, pairs, weights, math)
    prov = K["provider"].TritonExperts(decoder=decoder, config=cfg)
    out = torch.full((len(pairs), hidden), float("nan"))
    prov.forward(a, pairs, prov.prepare_weights(weights, math), math, out=out)
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-5


@pytest.mark.parametrize("decoder,quant,ride", [("frag8", "a8w4", False), ("frag8", "a8w4", True), ("frag8", "a4w4", True),
                                                ("frag", "bf16", False), ("frag", "a8w4", True), ("split", "a4w4", False)])
def test_short_tiles_match_reference(decoder, quant, ride):
    """TileConfig.tail_m: tiles whose rows from tail_m on are padding run at height tail_m; experts
    with 40 / 20 / 5 rows give 32-row tiles that are full, short (8 and 5 rows) and long-but-partial (20).
    ride (tail_ride): expert 0's short tile (8 rows) rides in its full tile's K loop, expert 2's (its
    only tile) still runs in the short launch: all three launches write rows."""
    weights, x, _ = _problem("mxfp4", tokens=65, **FRAG8_SHAPE.get(decoder, {}))
    g = torch.Generator().manual_seed(3)
    slot = torch.tensor([0] * 40 + [1] * 20 + [2] * 5)[torch.randperm(65, generator=g)]
    pairs = ExpertPairs(torch.randint(0, 65, (65,), generator=g), slot, torch.rand(65, generator=g))  # rows: any map
    cfg = K["config"].TileConfig(block_m=32, block_n1=64, block_n2=32, block_k=128 if decoder == "frag8" else 64,
                                 num_warps=4, num_stages=1, group_m=2, tail_m=16, tail_ride=ride)
    layout = K["layout"].build_layout(pairs.slot, 3, cfg.block_m)
    rows = layout.sorted_pair.view(-1, cfg.block_m)[: int((layout.tile_expert >= 0).sum())]
    short = rows[:, cfg.tail_m] < 0
    assert short.any() and (~short).any() and ((rows >= 0).sum(1)[~short] < cfg.block_m).any()
    math = ExpertMath(quant, 10.0)
    a = x if math.a_format is None else quantize_mx(x, math.a_format)
    ref = TorchReferenceExperts().forward(a, pairs, weights, math)
    prov = K["provider"].TritonExperts(decoder=decoder, config=cfg)
    out = torch.full((len(pairs), weights.hidden), float("nan"))
    prov.forward(a, pairs, prov.prepare_weights(weights, math), math, out=out)
    assert torch.isfinite(out).all(), "an output element was never written"
    assert _rel(out, ref) < 1e-5
    with pytest.raises(ValueError, match="tail_m=32"):
        cfg.with_(tail_m=32)
    with pytest.raises(ValueError, match="tail_ride needs tail_m"):
        cfg.with_(tail_m=0, tail_ride=True)
    with pytest.raises(ValueError, match="tail_max_registers=130"):
        cfg.with_(tail_max_registers=130)
    capped = cfg.with_(max_registers=168, tail_max_registers=128)  # the short launch has its own cap
    assert [capped.launch_registers(p) for p in ("full", "ride", "short")] == [168, 168, 128]
    assert cfg.with_(max_registers=168).launch_registers("short") == 168
    if ride:
        with pytest.raises(ValueError, match="tail_ride needs a fragment decoder"):
            K["provider"].TritonExperts(decoder="split", config=cfg).forward(a, pairs, weights, math)


@pytest.mark.parametrize("decoder,quant", [("frag8", "a8w4"), ("frag8", "a4w4"), ("frag", "bf16"), ("frag", "a4w4"),
                                           ("split", "a8w4"), ("manual", "a8w4")])
def test_a_rows_are_read_per_received_row(decoder, quant):
    """GEMM1 reads A per received row through pairs.row (A is converted once per received row, not
    copied per pair): pairs in any order, rows shared by several pairs, and a received row no pair
    references — here NaN, which must reach no output."""
    weights, x, _ = _problem("mxfp4", tokens=9, **FRAG8_SHAPE.get(decoder, {}))
    g = torch.Generator().manual_seed(11)
    row = torch.tensor([7, 2, 2, 0, 5, 8, 1, 7, 3, 2, 6, 0, 5, 7])  # row 4 is nobody's
    x[4] = float("nan")
    pairs = ExpertPairs(row, torch.randint(0, 3, (len(row),), generator=g), torch.rand(len(row), generator=g))
    math = ExpertMath(quant, 10.0)
    a = x if math.a_format is None else quantize_mx(x, math.a_format)
    ref = TorchReferenceExperts().forward(a, pairs, weights, math)
    prov = K["provider"].TritonExperts(decoder=decoder)
    out = prov.forward(a, pairs, prov.prepare_weights(weights, math), math)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5
    bad = ExpertPairs(row.clone(), pairs.slot, pairs.weight)
    bad.row[3] = 9  # one past the last received row
    with pytest.raises(ValueError, match=r"pairs.row out of range \[0, 9\) of the received rows: min 0, max 9"):
        prov.forward(a, bad, prov.prepare_weights(weights, math), math)
    with pytest.raises(ValueError, match="no received rows"):
        prov.forward(x[:0] if math.a_format is None else quantize_mx(x[:0], math.a_format), pairs,
                     prov.prepare_weights(weights, math), math)


WIRE_CASES = [("frag8", "a8w4", False), ("frag8", "a4w4", True), ("frag", "bf16", True), ("split", "a8w4", False),
              ("manual", "a4w4", False)]


@pytest.mark.parametrize("wire_name", ["bf16", "fp8_blockwise_1x32"])
@pytest.mark.parametrize("decoder,quant,short", WIRE_CASES)
def test_forward_wire_equals_encode_of_forward(decoder, quant, short, wire_name):
    """forward_wire: GEMM2's epilogue writes the combine wire row (bf16 RNE, or e4m3 + E8M0 per 1x32),
    byte for byte what the layer got before by encoding the fp32 rows (WireFormat.encode, torch);
    with short tiles (and riders for the fragment decoders) every launch's epilogue writes rows."""
    from megamoe_backend.formats.wire import combine_wire

    weights, x, _ = _problem("mxfp4", tokens=65, **FRAG8_SHAPE.get(decoder, {}))
    g = torch.Generator().manual_seed(5)
    slot = torch.tensor([0] * 40 + [1] * 20 + [2] * 5)[torch.randperm(65, generator=g)]
    pairs = ExpertPairs(torch.randint(0, 65, (65,), generator=g), slot, torch.rand(65, generator=g) * 3)
    cfg = None
    if short:
        cfg = K["config"].TileConfig(block_m=32, block_n1=64, block_n2=32, block_k=128 if decoder == "frag8" else 64,
                                     num_warps=4, num_stages=1, group_m=2, tail_m=16, tail_ride=decoder.startswith("frag"))
    math = ExpertMath(quant, 10.0)
    a = x if math.a_format is None else quantize_mx(x, math.a_format)
    prov = K["provider"].TritonExperts(decoder=decoder, config=cfg)
    used = prov.prepare_weights(weights, math)
    wire = combine_wire(wire_name)
    y = prov.forward(a, pairs, used, math)
    rows = torch.full((len(pairs), wire.row_bytes(weights.hidden)), 0xAB, dtype=torch.uint8)  # every byte must be written
    got = prov.forward_wire(a, pairs, used, math, wire, out=rows)
    assert got is rows
    assert torch.equal(got, wire.encode(y))
    assert _rel(wire.decode_fp32(got, weights.hidden), TorchReferenceExperts().forward(a, pairs, weights, math)) < (
        5e-3 if wire.mx is None else 5e-2)


def test_forward_wire_nan_and_bad_input():
    """A NaN token row poisons only its pairs' wire rows (fp8: the NaN scale); a wrong out buffer, a
    GEMM2 tile narrower than one 1x32 block for the fp8 wire, or a wire GEMM2 cannot write raise."""
    from megamoe_backend.formats.wire import WireFormat, combine_wire

    weights, x, pairs = _problem("mxfp4", tokens=4)
    x[1, 3] = float("nan")
    math = ExpertMath("a8w4", 10.0)
    a = quantize_mx(x, "fp8")
    prov = K["provider"].TritonExperts()
    hit = pairs.row == 1
    for name in ("bf16", "fp8_blockwise_1x32"):
        wire = combine_wire(name)
        got = prov.forward_wire(a, pairs, weights, math, wire)
        values = wire.decode_fp32(got, weights.hidden)
        assert torch.isnan(values[hit]).any(dim=1).all()
        assert torch.isfinite(values[~hit]).all()
        assert torch.equal(got[~hit], wire.encode(prov.forward(a, pairs, weights, math))[~hit])
    fp8 = combine_wire("fp8_blockwise_1x32")
    with pytest.raises(ValueError, match=r"out: expected contiguous uint8 \[.*fp8_blockwise_1x32 combine wire"):
        prov.forward_wire(a, pairs, weights, math, fp8, out=torch.empty(len(pairs), weights.hidden, dtype=torch.uint8))
    narrow = K["config"].TileConfig(block_m=16, block_n1=64, block_n2=16, block_k=64, num_stages=1)
    with pytest.raises(ValueError, match="TileConfig.block_n2=16 must be >= 32"):
        K["provider"].TritonExperts(decoder="split", config=narrow).forward_wire(a, pairs, weights, math, fp8)
    with pytest.raises(ValueError, match="writes bf16 or fp8_blockwise_1x32 rows"):
        prov.forward_wire(a, pairs, weights, math, WireFormat("fp4_rows", "fp4"))


def test_bf16_wire_is_quantised_on_the_receiver():
    weights, x, pairs = _problem("mxfp4")
    math = ExpertMath("a8w4", 10.0)
    from_bf16 = K["provider"].TritonExperts().forward(x, pairs, weights, math)
    from_fp8 = K["provider"].TritonExperts().forward(quantize_mx(x, "fp8"), pairs, weights, math)
    assert torch.equal(from_bf16, from_fp8)


def test_nan_row_poisons_only_its_pairs():
    weights, x, pairs = _problem("mxfp4", tokens=4)
    x[1, 3] = float("nan")
    out = K["provider"].TritonExperts().forward(quantize_mx(x, "fp8"), pairs, weights, ExpertMath("a8w4", 10.0))
    hit = pairs.row == 1
    assert torch.isnan(out[hit]).any(dim=1).all()
    assert torch.isfinite(out[~hit]).all()


def test_empty_pairs():
    weights, x, _ = _problem("mxfp4")
    empty = ExpertPairs(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0))
    out = K["provider"].TritonExperts().forward(x, empty, weights, ExpertMath("bf16"))
    assert out.shape == (0, weights.hidden)


def test_bad_inputs_raise_clear_errors():
    weights, x, pairs = _problem("mxfp4")
    te = K["provider"].TritonExperts
    math = ExpertMath("a8w4")
    with pytest.raises(ValueError, match="capacity"):
        te(capacity=len(pairs) - 1).forward(x, pairs, weights, math)
    with pytest.raises(ValueError, match="contiguous"):
        te().forward(torch.cat((x, x), dim=1)[:, ::2], pairs, weights, math)
    with pytest.raises(ValueError, match="bfloat16"):
        te().forward(x.float(), pairs, weights, math)
    with pytest.raises(ValueError, match="needs A operand fp8"):
        te().forward(quantize_mx(x, "fp4"), pairs, weights, math)
    bad_scale = ExpertWeights.__new__(ExpertWeights)  # bypass __post_init__ to reach the provider's own check
    for f, v in vars(weights).items():
        object.__setattr__(bad_scale, f, v)
    object.__setattr__(bad_scale, "w2_scale", weights.w2_scale[:, :, :1].contiguous())
    with pytest.raises(ValueError, match=r"weights\.w2_scale: expected torch.uint8 of shape"):
        te().forward(x, pairs, bad_scale, math)
    odd = quantize_expert_weights(torch.randn(2, 96, 48), torch.randn(2, 48, 48), "bf16")  # hidden 48
    p2 = ExpertPairs(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.ones(1))
    with pytest.raises(ValueError, match="multiples of 32"):
        te().forward(torch.randn(1, 48).to(torch.bfloat16), p2, odd, ExpertMath("bf16"))
    with pytest.raises(ValueError, match="pairs.slot"):
        te().forward(x, ExpertPairs(pairs.row, pairs.slot.int(), pairs.weight), weights, math)
    with pytest.raises(ValueError, match="dot_scaled"):
        te(decoder="dot_scaled").forward(x, pairs, weights, math)
    with pytest.raises(ValueError, match="prepare_weights"):  # frag reads fragment storage only
        te(decoder="frag").forward(x, pairs, weights, math)
    with pytest.raises(ValueError, match="fragment storage"):  # and split cannot read it
        te(decoder="split").forward(x, pairs, weights.as_fragments(), math)
    assert te().prepare_weights(odd) is odd  # bf16 weights have nothing to re-lay
    tiny = quantize_expert_weights(torch.randn(2, 64, 32), torch.randn(2, 32, 32), "mxfp4")  # hidden 32: K % 64
    assert te().prepare_weights(tiny).storage == "rowmajor"  # auto falls back to split
    with pytest.raises(ValueError, match="multiple of 64"):
        te(decoder="frag").prepare_weights(tiny)
    with pytest.raises(ValueError, match="needs MX activations"):
        te(decoder="frag8").prepare_weights(weights, ExpertMath("bf16"))
    assert te().prepare_weights(weights, math).storage == "fragments"  # K = 64: frag8 needs K % 128, auto takes frag
    with pytest.raises(ValueError, match="frag8 decoder .* K a multiple of 128"):
        te(decoder="frag8").prepare_weights(weights, math)
    w128, x128, pairs128 = _problem("mxfp4", **FRAG8_SHAPE["frag8"])
    assert te().prepare_weights(w128, math).storage == "fragments_fp8"  # auto: FP8 fragments for MX A
    assert te().prepare_weights(w128, ExpertMath("bf16")).storage == "fragments"  # bf16 fragments for bf16 A
    assert te().prepare_weights(w128).storage == "fragments"  # activations unknown: bf16 fragments
    with pytest.raises(ValueError, match="TileConfig.block_k=64 must be >= 128"):
        te(decoder="frag8", config=K["config"].INTERPRETER_CONFIG.with_(block_k=64)).forward(x128, pairs128, te().prepare_weights(w128, math), math)
    wide = quantize_expert_weights(torch.randn(2, 256, 128), torch.randn(2, 128, 128), "mxfp4")
    wide.w2[1, 5, 16:32] = 0x11  # every value 0.5 ...
    wide.w2_scale[1, 5, 1] = int(wide.w2_scale[1, 5, 0]) - 13  # ... 13 binades below the row's other block
    assert te().prepare_weights(wide, math).storage == "fragments"  # auto: frag8 cannot fold it, frag can
    with pytest.raises(ValueError, match=r"w2_scale: expert 1 row 5 has block scales spanning more than 11 binades"):
        te(decoder="frag8").prepare_weights(wide, math)
    f8 = te(decoder="frag8").prepare_weights(w128, math)
    assert f8.storage == "fragments_fp8"
    with pytest.raises(ValueError, match="needs MX activations"):  # fp8 fragments, bf16 activations
        te().forward(x128, pairs128, f8, ExpertMath("bf16"))
    with pytest.raises(ValueError, match="fp8 fragment storage"):
        te(decoder="frag").forward(x128, pairs128, f8, math)


@pytest.mark.parametrize("fmt,pk", [("fp8", 128), ("fp8", 256), ("fp4", 128)])
def test_rowscale_e4m3_matches_torch(fmt, pk):
    """frag8's A operand: MX rows -> e4m3 bytes over one power-of-two scale per row, checked against
    torch's own float8_e4m3fn rounding of value / 2**(s_max - 127); block scales up to 20 binades
    below the row's largest (the smallest values underflow or lose low bits, as documented), a NaN
    block makes the row scale NaN; the bytes land at the frag8 weights' MMA K positions
    (fragments.fp8_k_order), in one K step or several (PK). GEMM1's use writes received row r to
    output row r, every row; GEMM2's (SORTED) skips the padding rows of the expert-sorted A2."""
    g = torch.Generator().manual_seed(7)
    rows, k = 5, 256
    x = torch.randn(rows, k, generator=g) * torch.pow(2.0, -torch.randint(0, 21, (rows, k // 32), generator=g).float()).repeat_interleave(32, 1)
    x[3, 40] = float("nan")
    mx = quantize_mx(x, fmt)
    unused = torch.full((1,), -7, dtype=torch.int32)  # SORTED=False never reads sorted_pair
    out = torch.full((rows, k), 0xAB, dtype=torch.uint8)
    rs = torch.full((rows,), -1.0)
    K["gather"].rowscale_e4m3_kernel[(rows,)](
        unused, mx.data, mx.data.stride(0), mx.scales, mx.scales.stride(0), out, out.stride(0), rs, k,
        A_FMT=fmt, SORTED=False, NB=k // 32, PK=pk, HW_CVT=False,
    )
    order = fp8_k_order(k)  # MMA position -> natural K
    assert not torch.equal(order, torch.arange(k))
    for r in range(rows):
        smax = int(mx.scales[r].max())
        if smax == 255:
            assert r == 3 and torch.isnan(rs[r])
            continue
        assert rs[r] == 2.0 ** (smax - 127)
        vals = dequantize_mx(MXTensor(mx.data[r : r + 1], mx.scales[r : r + 1], fmt))[0].double()
        want = (vals / 2.0 ** (smax - 127)).float().to(torch.float8_e4m3fn).float()
        assert torch.equal(out[r].view(torch.float8_e4m3fn).float(), want[order]), f"row {r}"  # -0 == +0
    if fmt == "fp8":  # GEMM2's use: rows already sorted, rescaled in place (each step reads before it writes)
        sorted_pair = torch.tensor([2, -1, 0, 4, 3, 1], dtype=torch.int32)  # sorted row -> pair (-1: padding)
        src_of = {0: 2, 2: 0, 3: 4, 4: 3, 5: 1}  # sorted row -> the row of x it holds
        a2 = torch.zeros(6, k, dtype=torch.uint8)
        a2_scale = torch.full((6, k // 32), 127, dtype=torch.uint8)
        for r, src in src_of.items():
            a2[r], a2_scale[r] = mx.data[src], mx.scales[src]
        rs2 = torch.full((6,), -1.0)
        K["gather"].rowscale_e4m3_kernel[(6,)](
            sorted_pair, a2, a2.stride(0), a2_scale, a2_scale.stride(0), a2, a2.stride(0), rs2, k,
            A_FMT=fmt, SORTED=True, NB=k // 32, PK=pk, HW_CVT=False,
        )
        live, src = torch.tensor(list(src_of)), torch.tensor(list(src_of.values()))
        assert torch.equal(a2[live], out[src]) and torch.equal(rs2[live].nan_to_num(-2.0), rs[src].nan_to_num(-2.0))
        assert not a2[1].any() and rs2[1] == -1.0  # padding row untouched
    assert [K["gather"].rowscale_piece(v) for v in (128, 384, 3072, 7168, 4096)] == [128, 128, 1024, 1024, 1024]


def test_provider_selection_on_cpu_is_the_reference():
    sel = K["provider"].select_experts_provider("cpu", ExpertMath("a8w4"), "mxfp4")
    assert isinstance(sel, TorchReferenceExperts)
    assert not K["provider"].TritonExperts.supports(torch.device("cpu"), ExpertMath("a8w4"), "mxfp4")


def test_bench_smoke(tmp_path):
    from benchmarks import bench_experts

    out = tmp_path / "b.json"
    rc = bench_experts.main(["--experts", "3", "--tokens", "2", "--hidden", "64", "--intermediate", "64", "--topk", "2",
                             "--schemes", "a8w4", "--no-baseline", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    assert len(res) == 1 and res[0]["error"] == "" and res[0]["rel_l2_ref"] < 1e-5 and res[0]["floor_us"] > 0
    assert res[0]["out"] == "bf16"  # the layer's default combine wire (forward_wire)
    assert res[0]["us_isolated"] != res[0]["us_isolated"]  # NaN: single replays after idle need a CUDA graph
    rc = bench_experts.main(["--experts", "3", "--tokens", "2", "--hidden", "64", "--intermediate", "64", "--topk", "2",
                             "--schemes", "a8w4", "--no-baseline", "--combine-wire", "fp32", "--json", str(out)])
    res = json.loads(out.read_text())["results"]
    assert rc == 0 and res[0]["out"] == "fp32" and res[0]["error"] == "" and res[0]["rel_l2_ref"] < 1e-5
