"""The device forward of MegaMoELayer on a CUDA GPU (H200): sync-free, capturable, = eager.

What the interpreter tests (test_device_forward_interpreter.py) cannot show: eager forwards under
``torch.cuda.set_sync_debug_mode("error")``; one forward captured in a CUDA graph and replayed with
other tokens and routing (masked ids, an empty batch, a full MTPR batch) equal to eager bit for
bit; a 61-layer chain (RMSNorm + residual, independent routing per layer) captured in one graph;
bad ids and NaN rows reported from a replayed graph; the accuracy gates at DSV4-Pro's hidden size, and
every row near the torch-emulated quantised layer (tests/kernels/quantised_twin.py: the gates
are the accuracy claim, the twin catches wrong math the gates let through). Skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the interpreter tests cover the kernels on CPU)", allow_module_level=True)
pytest.importorskip("triton")

from benchmarks.bench_experts import make_weights  # noqa: E402
from megamoe_backend.knobs import Knobs  # noqa: E402
from megamoe_backend.layer import MegaMoELayer, fp32_reference_moe, rel_l2  # noqa: E402
from megamoe_backend.plan import build_plan  # noqa: E402
from megamoe_backend.spec import preset  # noqa: E402
from megamoe_backend.transport import LocalTransport, PeerInputError, clear_transport_cache  # noqa: E402
from quantised_twin import assert_rows_near, tolerances, torch_emulated_layer  # noqa: E402

DEV = torch.device("cuda")
SPEC = preset("dsv4-pro").scaled(n_routed_experts=16)  # hidden 7168, intermediate 3072, top-6
K = SPEC.num_experts_per_tok
MTPR = 64
GATES = {"bf16": 0.01, "a8w4": 0.10, "a4w4": 0.28}
CASES = [("bf16", "bf16", "bf16"), ("a8w4", "fp8", "bf16"), ("a8w4", "fp8", "fp8_blockwise_1x32"),
         ("a4w4", "fp4", "bf16"), ("a4w4", "fp4", "fp8_blockwise_1x32"), ("a8w4", "bf16", "bf16")]
_WEIGHTS: dict = {}


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_transport_cache()
    yield
    clear_transport_cache()


class Routing:
    """Tokens and uniform random top-k routing, made on the GPU (seeded)."""

    def __init__(self, tokens, seed, masked=0.0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        e = SPEC.n_routed_experts
        self.x = torch.randn(tokens, SPEC.hidden_size, generator=g, device=DEV).to(torch.bfloat16)
        ids = torch.rand(tokens, e, generator=g, device=DEV).topk(K, dim=1).indices
        drop = torch.rand(tokens, K, generator=g, device=DEV) < masked
        self.topk_ids = torch.where(drop, torch.full_like(ids, -1), ids)
        w = torch.rand(tokens, K, generator=g, device=DEV)
        self.topk_weights = w / w.sum(1, keepdim=True)




def weights_for(quant):
    """MXFP4 experts (Triton-quantised on the GPU) and their exact bf16 dequantisation."""
    if not _WEIGHTS:
        _WEIGHTS["mxfp4"], _WEIGHTS["bf16"] = make_weights(SPEC.n_routed_experts, SPEC.hidden_size,
                                                           SPEC.moe_intermediate_size, DEV, seed=11)
    return _WEIGHTS["bf16" if quant == "bf16" else "mxfp4"]


def reference(p):
    w = weights_for("bf16")
    return fp32_reference_moe(p.x, p.topk_ids, p.topk_weights, w.w1.float(), w.w2.float(), "interleaved", SPEC.swiglu_limit)


def layer_for(quant, wire, combine, **kw):
    plan = build_plan(SPEC, Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=MTPR), quant=quant,
                      device_type="cuda")
    layer = MegaMoELayer(plan, weights_for(quant), device=DEV, **kw)
    assert layer.workspace is not None, "CUDA + ep_size 1 + triton experts must take the device forward"
    return layer


def bits(t):
    return t.view(torch.int16)


class Captured:
    """One forward captured at a fixed T, replayed on new contents of its static inputs."""

    def __init__(self, layer, tokens):
        p = Routing(tokens, seed=100)
        self.x, self.ids, self.w = p.x.clone(), p.topk_ids.clone(), p.topk_weights.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer(self.x, self.ids, self.w)  # warm-up: compiles every kernel outside the capture
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = layer(self.x, self.ids, self.w)

    def __call__(self, x, ids, w):
        self.x.copy_(x)
        self.ids.copy_(ids)
        self.w.copy_(w)
        self.graph.replay()
        return self.out.clone()


@pytest.mark.parametrize("quant, wire, combine", CASES)
def test_eager_forward_is_sync_free_and_within_the_gates(quant, wire, combine) -> None:
    layer = layer_for(quant, wire, combine)
    p = Routing(MTPR, seed=1, masked=0.1)
    layer(p.x, p.topk_ids, p.topk_weights)  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for seed in (2, 3):
            q = Routing(MTPR, seed=seed, masked=0.1)
            out = layer(q.x, q.topk_ids, q.topk_weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_l2(out.float(), reference(q)) < GATES[quant]


@pytest.mark.parametrize("quant, wire, combine", CASES)
def test_rows_stay_near_the_torch_emulated_quantised_layer(quant, wire, combine) -> None:
    """Every output row within quantised_twin.tolerances (2e-2 relative; on the fp8 combine wire 6e-2 worst
    row / 4e-2 mean row, derived from the experts' tolerance in quantised_twin.py) of the same plan run
    by the reference experts (fp64 products, the same A / A2 quantisation and wires), at DSV4-Pro
    shapes, 10 % masked routes. The planted mutations (output x1.05, a wrong scale exponent, a dropped
    pair) were run once against this check's CPU twin,
    test_device_forward_interpreter.py::test_device_forward_rows_stay_near_the_torch_emulated_quantised_layer,
    and each failed it; this GPU check has the same bound and comparison."""
    layer = layer_for(quant, wire, combine)
    twin = torch_emulated_layer(layer, weights_for(quant), DEV)
    p = Routing(MTPR, seed=13, masked=0.1)
    worst = assert_rows_near(layer(p.x, p.topk_ids, p.topk_weights), twin(p.x, p.topk_ids, p.topk_weights),
                             f"{quant}/{wire}/{combine}", combine)
    print(f"{quant}/{wire}/{combine}: worst row {worst:.2e} of the torch-emulated layer (bounds {tolerances(combine)})")


@pytest.mark.parametrize("quant, wire, combine", CASES)
def test_device_forward_equals_the_torch_forward(quant, wire, combine) -> None:
    """Same Triton experts, the old torch exchange (LocalTransport): the same bits, no masked ids
    (so both forwards hand the experts the same pair count and tile config)."""
    device = layer_for(quant, wire, combine)
    torch_path = MegaMoELayer(device.plan, weights_for(quant), device=DEV, transport=LocalTransport())
    assert torch_path.workspace is None
    p = Routing(MTPR, seed=4)
    for scale in (1.0, 2.5):  # output_scale multiplies the fp32 sum before the one bf16 rounding
        assert torch.equal(bits(device(p.x, p.topk_ids, p.topk_weights, output_scale=scale)),
                           bits(torch_path(p.x, p.topk_ids, p.topk_weights, output_scale=scale)))


@pytest.mark.parametrize("quant, wire, combine", CASES)
def test_graph_replay_equals_eager_for_new_tokens_and_routing(quant, wire, combine) -> None:
    layer = layer_for(quant, wire, combine)
    graph = Captured(layer, MTPR)  # a full MTPR batch
    for seed, masked in ((5, 0.0), (6, 0.3), (7, 1.0)):  # new routing, masked ids, every entry masked
        p = Routing(MTPR, seed=seed, masked=masked)
        got = graph(p.x, p.topk_ids, p.topk_weights)
        assert torch.equal(bits(got), bits(layer(p.x, p.topk_ids, p.topk_weights)))
        if masked == 1.0:
            assert torch.equal(got, torch.zeros_like(got))
    small = Captured(layer, 3)
    p = Routing(3, seed=8, masked=0.2)
    assert torch.equal(bits(small(p.x, p.topk_ids, p.topk_weights)), bits(layer(p.x, p.topk_ids, p.topk_weights)))
    empty = layer(p.x[:0], p.topk_ids[:0], p.topk_weights[:0])  # the empty batch: nothing to launch
    assert empty.shape == (0, SPEC.hidden_size)


def rms_norm(h, eps=1e-6):
    return (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)


def test_61_layer_chain_in_one_graph_equals_eager() -> None:
    first = layer_for("a8w4", "fp8", "bf16")
    layers = [first] + [MegaMoELayer(first.plan, first.weights, device=DEV, layer_id=i) for i in range(1, 61)]
    assert all(layer.workspace is first.workspace for layer in layers)
    routes = [Routing(MTPR, seed=200 + i) for i in range(61)]
    x0 = Routing(MTPR, seed=199).x

    def chain(x):
        h = x
        for layer, r in zip(layers, routes):
            h = h + layer(rms_norm(h), r.topk_ids, r.topk_weights)
        return h

    eager = chain(x0)
    static_x = x0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_x)
    for seed in (300, 400):
        for i, r in enumerate(routes):  # independent new routing in every layer
            q = Routing(MTPR, seed=seed + i)
            r.topk_ids.copy_(q.topk_ids)
            r.topk_weights.copy_(q.topk_weights)
        static_x.copy_(x0)
        graph.replay()
        assert torch.equal(bits(static_out), bits(chain(x0)))
    assert not torch.equal(bits(static_out), bits(eager))  # the routing did change


@pytest.mark.parametrize("replayed", [False, True])
def test_bad_id_reported_at_the_next_forward(replayed) -> None:
    layer = layer_for("a8w4", "fp8", "bf16")
    p = Routing(MTPR, seed=9)
    bad = p.topk_ids.clone()
    bad[5, 2] = SPEC.n_routed_experts + 3
    masked = bad.clone()
    masked[5, 2] = -1
    run = Captured(layer, MTPR) if replayed else layer
    got = run(p.x, bad, p.topk_weights)  # no exception here: the check is on the device
    torch.cuda.current_stream().synchronize()  # an engine's per-step read of its sampled tokens
    with pytest.raises(ValueError, match=rf"topk_ids holds {SPEC.n_routed_experts + 3} at token 5"):
        layer(p.x, masked, p.topk_weights)
    assert torch.equal(bits(got), bits(layer(p.x, masked, p.topk_weights)))  # the bad entry gave nothing


@pytest.mark.parametrize("replayed", [False, True])
def test_nan_row_reported_at_the_next_forward(replayed) -> None:
    layer = layer_for("a4w4", "fp4", "fp8_blockwise_1x32")
    p = Routing(MTPR, seed=10)
    x = p.x.clone()
    x[7] = float("nan")
    run = Captured(layer, MTPR) if replayed else layer
    got = run(x, p.topk_ids, p.topk_weights)
    torch.cuda.current_stream().synchronize()
    with pytest.raises(ValueError, match=r"hidden_states row 7 holds NaN/Inf \(found while quantising it\)"):
        layer.raise_if_bad_input()
    clean = layer(p.x, p.topk_ids, p.topk_weights)
    keep = torch.arange(MTPR, device=DEV) != 7
    assert torch.equal(bits(got[keep]), bits(clean[keep]))


def test_too_many_tokens_fail_from_shapes() -> None:
    layer = layer_for("bf16", "bf16", "bf16")
    p = Routing(MTPR + 1, seed=12)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(PeerInputError, match=f"exceed MEGA_MAX_TOKENS_PER_RANK={MTPR}"):
            layer(p.x, p.topk_ids, p.topk_weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
