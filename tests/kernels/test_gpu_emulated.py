"""The one-process emulated EP (benchmarks/emulated_ep.py) and the live-row experts on a CUDA GPU.

What is shown, DSV4-Pro hidden / intermediate, 16 experts over EP 2 and 4, uneven DP batches
(an idle rank among them), 20 % masked ids:
- every (quant, dispatch wire, combine wire): bit-identical to the ep_size-1 device forward on the
  same tokens, with the bound passed and without it (regions sized by MEGA_MAX_TOKENS_PER_RANK, the
  tile config picked on the device), and within the accuracy gates vs fp32;
- eager emulated steps issue no host synchronisation (``set_sync_debug_mode("error")``) and, once
  one forward has run, allocate nothing but their outputs (CUDA allocator statistics);
- the whole emulated step (every rank, in turn) captured in ONE CUDA graph and replayed with new
  tokens and routing equals eager bit for bit;
- the ranks sharing one experts scratch (what the bench runs) give the same bits, eager and from one graph;
- a bad expert id is raised on its rank only;
- 1100 and 40 tokens per rank: the dispatch's wider pieces give the narrow pieces' bits.
Per-rank speed: ``megamoe bench layer --ep N --emulate`` (benchmarks/results/h200_layer_ep_emulated.json).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (tests/kernels/test_live_interpreter.py covers the emulator on CPU)",
                allow_module_level=True)
pytest.importorskip("triton")

from benchmarks.bench_experts import capture_graph, make_weights  # noqa: E402
from megamoe_backend.knobs import Knobs  # noqa: E402
from megamoe_backend.layer import MegaMoELayer, fp32_reference_moe, rel_l2  # noqa: E402
from benchmarks.emulated_ep import EmulatedEP  # noqa: E402
from megamoe_backend.plan import build_plan  # noqa: E402
from megamoe_backend.spec import preset  # noqa: E402
from megamoe_backend.transport import clear_transport_cache  # noqa: E402
from megamoe_backend.workload.problem import local_weights  # noqa: E402

SPEC = preset("dsv4-pro").scaled(n_routed_experts=16)
K = SPEC.num_experts_per_tok
MTPR = 256
GATES = {"bf16": 0.01, "a8w4": 0.10, "a4w4": 0.28}
CASES = [("bf16", "bf16", "bf16"), ("a8w4", "fp8", "bf16"), ("a8w4", "fp8", "fp8_blockwise_1x32"),
         ("a4w4", "fp4", "bf16"), ("a8w4", "bf16", "bf16")]
TOKENS = {2: (40, 0), 4: (0, 20, 40, 7)}


@pytest.fixture(scope="module")
def weights():
    return make_weights(SPEC.n_routed_experts, SPEC.hidden_size, SPEC.moe_intermediate_size, torch.device("cuda"), seed=5)


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_transport_cache()
    yield
    clear_transport_cache()


def inputs_for(tokens, seed, masked=0.2):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for t in tokens:
        x = torch.randn(t, SPEC.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.rand(t, SPEC.n_routed_experts, generator=g, device="cuda").topk(K, dim=1).indices
        ids = torch.where(torch.rand(t, K, generator=g, device="cuda") < masked, torch.full_like(ids, -1), ids)
        w = torch.rand(t, K, generator=g, device="cuda")
        out.append((x, ids, w / w.sum(1, keepdim=True)))
    return out


def emulated(world, case, weights, mtpr=MTPR, share_scratch=False):
    quant, wire, combine = case
    knobs = Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=mtpr, transport="ipc")
    plans = [build_plan(SPEC, knobs, r, world, quant=quant, device_type="cuda") for r in range(world)]
    full = weights[1] if quant == "bf16" else weights[0]
    return EmulatedEP(world, plans.__getitem__, lambda r: local_weights(full, plans[r].placement, r), torch.device("cuda"),
                      share_scratch=share_scratch)


def ep1(case, weights, inputs):
    quant, wire, combine = case
    clear_transport_cache()
    plan = build_plan(SPEC, Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=MTPR * 4), quant=quant,
                      device_type="cuda")
    layer = MegaMoELayer(plan, weights[1] if quant == "bf16" else weights[0], device="cuda")
    x, ids, w = (torch.cat([i[j] for i in inputs]) for j in range(3))
    ref = fp32_reference_moe(x, ids, w, weights[1].w1.float(), weights[1].w2.float(), "interleaved", SPEC.swiglu_limit)
    return layer(x, ids, w), ref


@pytest.mark.parametrize("world,share", [(2, False), (4, False), (4, True)], ids=["ep2", "ep4", "ep4-shared-scratch"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_emulated_ep_equals_ep1_bound_or_not(world, share, case, weights):
    """Bits against the ep_size-1 device forward with the same wires (the exact twin), the gate as the
    accuracy claim. Planted mutations of the P2P dispatch (layer/device/p2p.py: the route weights x 1.05 as dispatched, the first E8M0 block of every dispatched fp8 row one binade
    high, and the pair of (rank 0, token 1, k 0) sent with no slot)
    were run once (tree 2377c6c + issue 46) against this check's CPU twin,
    test_live_interpreter.py::test_emulated_ep_equals_the_ep1_device_forward: each failed its bit check."""
    emu = emulated(world, case, weights, share_scratch=share)  # shared: what bench layer --emulate runs
    inputs = inputs_for(TOKENS[world], seed=world)
    bound = max(TOKENS[world])
    emu.forward(inputs, bound)  # compiles
    emu.forward(inputs)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        bounded_outs = emu.forward(inputs, bound)
        unbounded_outs = emu.forward(inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # no allocation per call: the two forwards allocate their outputs only (the experts' intermediates
    # live in the workspace's scratch, reserved at capacity by the first forward: experts/scratch.py)
    allocated = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    assert allocated <= 2 * world, allocated
    bounded, unbounded = torch.cat(bounded_outs), torch.cat(unbounded_outs)
    emu.raise_if_bad_input()
    want, fp32 = ep1(case, weights, inputs)
    assert torch.equal(bounded.view(torch.int16), want.view(torch.int16)), case
    assert torch.equal(unbounded.view(torch.int16), want.view(torch.int16)), case
    assert rel_l2(bounded.float(), fp32) < GATES[case[0]]


@pytest.mark.parametrize("case", CASES[1:4], ids=["-".join(c) for c in CASES[1:4]])
def test_prefill_sized_dispatch_in_wider_pieces_equals_narrow_pieces(case, weights, monkeypatch):
    """1100 and 40 tokens: the ranks dispatch in pieces of 32 and 16 blocks (layer/device/p2p.py
    blocks_per_program), not the decode steps' 8; the same forward with the pieces held at 8 must
    give the same bits, and both hold the gate."""
    from megamoe_backend.layer.device import p2p

    tokens = (1100, 40)
    assert [p2p.blocks_per_program(t, SPEC.hidden_size) for t in tokens] == [32, 16]
    emu = emulated(2, case, weights, mtpr=1100)
    inputs = inputs_for(tokens, seed=11)
    wide = torch.cat(emu.forward(inputs, max(tokens)))
    pick = p2p.blocks_per_program  # the dispatch asks it for its width: offer the narrowest only
    monkeypatch.setattr(p2p, "blocks_per_program", lambda tokens, hidden: pick(tokens, hidden, widths=(8,)))
    narrow = torch.cat(emu.forward(inputs, max(tokens)))
    emu.raise_if_bad_input()
    assert torch.equal(wide.view(torch.int16), narrow.view(torch.int16)), case
    x, ids, w = (torch.cat([i[j] for i in inputs]) for j in range(3))
    fp32 = fp32_reference_moe(x, ids, w, weights[1].w1.float(), weights[1].w2.float(), "interleaved", SPEC.swiglu_limit)
    assert rel_l2(wide.float(), fp32) < GATES[case[0]]


@pytest.mark.parametrize("bounded", [True, False], ids=["bound", "no-bound"])
def test_one_graph_of_the_emulated_step_replays_like_eager(bounded, weights):
    world, case = 4, ("a8w4", "fp8", "fp8_blockwise_1x32")
    emu = emulated(world, case, weights, share_scratch=True)  # as the bench's step graph runs it
    static = inputs_for(TOKENS[world], seed=1)
    bound = max(TOKENS[world]) if bounded else None
    outs = []
    graph = capture_graph(lambda: outs.append(emu.forward(static, bound)))
    for seed in (2, 3, 4):
        for (x, ids, w), (nx, nids, nw) in zip(static, inputs_for(TOKENS[world], seed=seed, masked=0.3)):
            x.copy_(nx)
            ids.copy_(nids)
            w.copy_(nw)
        graph.replay()
        replayed = torch.cat(outs[-1]).clone()
        eager = torch.cat(emu.forward(static, bound))
        assert torch.equal(replayed.view(torch.int16), eager.view(torch.int16)), seed
    emu.raise_if_bad_input()


def test_a_bad_id_is_raised_on_its_rank_only(weights):
    emu = emulated(2, ("a8w4", "fp8", "bf16"), weights)
    inputs = inputs_for((8, 8), seed=9)
    x, ids, w = inputs[1]
    bad = ids.clone()
    bad[3, 2] = 999
    emu.forward([inputs[0], (x, bad, w)], 8)
    torch.cuda.synchronize()
    emu.layers[0].raise_if_bad_input()
    with pytest.raises(ValueError, match="topk_ids holds 999 at token 3"):
        emu.layers[1].raise_if_bad_input()
