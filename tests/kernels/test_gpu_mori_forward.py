"""The mori device forward (layer/forwards/mori.py) on a CUDA GPU, over a sync-free stand-in for one
rank of mori's EpDispatchCombineOp: no host synchronisation (``set_sync_debug_mode("error")``), bit
for bit the ep_size-1 device forward on the same experts (its exact twin here: every route is this
rank's, so the same pairs, the same bf16 pair rows, the same fp32 sums in k order), one forward
captured in a CUDA graph and replayed on other tokens equal to eager bit for bit, and the answer
within the accuracy gate of the fp32 reference.

Run on one H200 (2026-12-04): 2 passed. The first run found two bugs the CPU tests had not:
``ids[first]`` with a 0-d index in id_check.py (a host read: sync-debug mode raised; the CPU guard
now catches it, mutant ``id-check-scalar-index``) and mori's receiver keeping a masked k = 0's
weight-0 copy instead of the real entry (rows off by up to 0.9 vs the device forward, relL2 0.156;
transport/mori.py local_slots, mutant ``local-slots-first-weight``).

What this shows and what it does not: everything of the forward but mori -- the torch routing, the
status word, the Triton experts over mori's live-row count, the live-row pair sum -- runs on a GPU
without a host read and is capturable. The stand-in is not mori: rank 0 of a 2-rank world whose
peer sends nothing and whose every token is delivered here (``StandInOp``); mori's own kernels, and
HIP graphs on an AMD GPU, are not run (docs/rocm.md). Skips without CUDA.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (tests/rocm/test_mori_device_forward.py runs it under the interpreter)",
                allow_module_level=True)
pytest.importorskip("triton")

from benchmarks.bench_experts import make_weights  # noqa: E402
from megamoe_backend.experts.triton import TritonExperts  # noqa: E402
from megamoe_backend.knobs import Knobs  # noqa: E402
from megamoe_backend.layer import MegaMoELayer, fp32_reference_moe, rel_l2  # noqa: E402
from megamoe_backend.plan import build_plan  # noqa: E402
from megamoe_backend.spec import preset  # noqa: E402
from megamoe_backend.transport import clear_transport_cache  # noqa: E402
from megamoe_backend.transport.mori import MoriWire  # noqa: E402

DEV = torch.device("cuda")
SPEC = preset("dsv4-pro").scaled(n_routed_experts=16)  # hidden 7168, intermediate 3072, top-6
K, EP, MTPR = SPEC.num_experts_per_tok, 2, 64
LOCAL = SPEC.n_routed_experts // EP  # rank 0 owns experts 0..7
GATE = 0.10  # a8w4 vs the fp32 reference (the project's gate)


class StandInOp:
    """One rank of mori's dispatch / combine in device ops on fixed buffers: every token arrives here
    once (its ids as sent), ``total_recv`` is a device count, the peer contributes nothing to combine.
    The call signatures and return tuples are mori 1.2.4's (tests/rocm/fakes/mori/ops)."""

    def __init__(self, wire: MoriWire) -> None:
        r = EP * MTPR
        self.out = torch.zeros(r, wire.payload_cols, dtype=wire.data_type, device=DEV)
        self.out_s = torch.zeros(r, max(wire.scale_dim, 1), dtype=torch.uint8, device=DEV)
        self.out_w = torch.zeros(r, K, dtype=torch.float32, device=DEV)
        self.out_i = torch.full((r, K), -1, dtype=torch.int32, device=DEV)
        self.total = torch.zeros(1, dtype=torch.int32, device=DEV)
        self.combined = torch.zeros(MTPR, SPEC.hidden_size, dtype=torch.bfloat16, device=DEV)

    def dispatch(self, payload, weights, scales, indices):
        t = payload.shape[0]
        self.out[:t].copy_(payload)
        if scales is not None:
            self.out_s[:t].copy_(scales)
        self.out_w[:t].copy_(weights)
        self.out_i[:t].copy_(indices)
        self.total.fill_(t)
        return self.out, self.out_w, self.out_s if scales is not None else None, self.out_i, self.total

    def combine(self, partial, weights, indices):
        t = indices.shape[0]
        self.combined[:t].copy_(partial[:t])
        return self.combined, None


def layer_for(wire: str) -> MegaMoELayer:
    plan = build_plan(SPEC, Knobs(dispatch_wire=wire, max_tokens_per_rank=MTPR), ep_rank=0, ep_size=EP, quant="a8w4",
                      backends=("triton", "mori"))
    w = MoriWire.from_knobs(wire, "bf16", SPEC.hidden_size)
    transport = SimpleNamespace(name="mori", wire=w, op=StandInOp(w), rank=0, ep_size=EP, experts_per_rank=LOCAL,
                                recv_capacity=EP * MTPR)
    mxfp4, _ = make_weights(LOCAL, SPEC.hidden_size, SPEC.moe_intermediate_size, DEV, seed=11)
    layer = MegaMoELayer(plan, mxfp4, device=DEV, group=object(), transport=transport, device_path=True,
                         provider=TritonExperts(capacity=EP * MTPR * K))
    assert layer.transport_name == "device mori"
    return layer


def routing(tokens: int, seed: int):
    """Tokens routed to rank 0's experts only (the stand-in's peer computes nothing), 10 % masked."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(tokens, SPEC.hidden_size, generator=g, device=DEV).to(torch.bfloat16)
    ids = torch.rand(tokens, LOCAL, generator=g, device=DEV).topk(K, dim=1).indices
    ids = torch.where(torch.rand(tokens, K, generator=g, device=DEV) < 0.1, torch.full_like(ids, -1), ids)
    w = torch.rand(tokens, K, generator=g, device=DEV)
    return x, ids, w / w.sum(1, keepdim=True)


@pytest.fixture(autouse=True)
def _fresh():
    clear_transport_cache()
    yield
    clear_transport_cache()


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
def test_mori_device_forward_is_sync_free_capturable_and_within_the_gate(wire):
    layer = layer_for(wire)
    layer(*routing(MTPR, seed=1))  # compiles every kernel outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x, ids, w = routing(MTPR, seed=2)
        eager = layer(x, ids, w).clone()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mxfp4, w_bf16 = make_weights(LOCAL, SPEC.hidden_size, SPEC.moe_intermediate_size, DEV, seed=11)
    want = fp32_reference_moe(x, ids, w, w_bf16.w1.float(), w_bf16.w2.float(), "interleaved", SPEC.swiglu_limit)
    assert rel_l2(eager.float(), want) < GATE
    alone = build_plan(SPEC.scaled(n_routed_experts=LOCAL), Knobs(dispatch_wire=wire, max_tokens_per_rank=MTPR),
                       quant="a8w4", device_type="cuda")
    twin = MegaMoELayer(alone, mxfp4, device=DEV)
    assert twin.transport_name == "device"
    assert torch.equal(eager.view(torch.int16), twin(x, ids, w).view(torch.int16))

    static = [t.clone() for t in routing(MTPR, seed=3)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(*static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(*static)
    for seed in (2, 4):
        fresh = routing(MTPR, seed=seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), layer(*fresh).view(torch.int16))
