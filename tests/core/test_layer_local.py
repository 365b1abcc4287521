"""MegaMoELayer in one process (ep_size 1): accuracy gates, wires, masking, NaN isolation, bad input."""

from __future__ import annotations

import pytest
import torch

from megamoe_backend.experts import TorchReferenceExperts, ExpertMath, ExpertPairs, deinterleave_gate_up, quantize_expert_weights
from megamoe_backend.formats import quantize_mx
from megamoe_backend.knobs import Knobs
from megamoe_backend.layer import MegaMoELayer, fp32_reference_moe, rel_l2
from megamoe_backend.plan import build_plan
from megamoe_backend.spec import preset
from megamoe_backend.transport import PeerInputError
from megamoe_backend.workload import ProblemConfig, make_problem

SPEC = preset("dsv4-pro").scaled(hidden_size=256, moe_intermediate_size=128, n_routed_experts=16)
GATES = {"bf16": 0.01, "a8w4": 0.10, "a4w4": 0.28}


def layer_for(quant, wire="bf16", combine="bf16", mtpr=8192, problem=None):
    problem = problem or make_problem(ProblemConfig(SPEC, 48, 1, seed=3))
    plan = build_plan(SPEC, Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=mtpr), quant=quant)
    return MegaMoELayer(plan, problem.expert_weights(quant)), problem


@pytest.mark.parametrize("quant", ["bf16", "a8w4", "a4w4"])
def test_accuracy_gates_vs_fp32_reference(quant) -> None:
    layer, p = layer_for(quant)
    w1, w2 = layer.weights.dequantized()
    ref = fp32_reference_moe(p.x, p.topk_ids, p.topk_weights, w1, w2, "interleaved", SPEC.swiglu_limit)
    err = rel_l2(layer(p.x, p.topk_ids, p.topk_weights).float(), ref)
    assert err < GATES[quant], f"{quant}: relL2 {err:.4f}"


@pytest.mark.parametrize("quant, wire", [("a8w4", "fp8"), ("a4w4", "fp4")])
def test_sender_side_quantisation_equals_receiver_side(quant, wire) -> None:
    """Quantised wire (sender quantises) == bf16 wire (receiver quantises), bit for bit."""
    sender, p = layer_for(quant, wire)
    receiver, _ = layer_for(quant, "bf16", problem=p)
    assert torch.equal(sender(p.x, p.topk_ids, p.topk_weights), receiver(p.x, p.topk_ids, p.topk_weights))
    # and the bytes on the wire are exactly the receiver's quantisation of the bf16 row
    rows = sender.plan.dispatch.encode(p.x)
    q = quantize_mx(p.x.float(), wire)
    assert torch.equal(rows, torch.cat((q.data, q.scales), 1))


def test_plain_and_interleaved_gate_up_agree() -> None:
    p = make_problem(ProblemConfig(SPEC, 8, 1, seed=5))
    inter = quantize_expert_weights(p.w1, p.w2, "bf16", "interleaved")
    plain = quantize_expert_weights(deinterleave_gate_up(p.w1), p.w2, "bf16", "plain")
    pairs = ExpertPairs(torch.arange(8), torch.arange(8) % 16, torch.ones(8))
    math = ExpertMath("bf16", 10.0)
    prov = TorchReferenceExperts()
    assert torch.equal(prov.forward(p.x, pairs, inter, math), prov.forward(p.x, pairs, plain, math))


def test_masked_route_contributes_nothing() -> None:
    layer, p = layer_for("bf16")
    ids = p.topk_ids.clone()
    ids[:, 3:] = -1
    ids[0] = -1
    out = layer(p.x, ids, p.topk_weights)
    assert (out[0] == 0).all()
    w1, w2 = layer.weights.dequantized()
    ref = fp32_reference_moe(p.x, ids, p.topk_weights, w1, w2, "interleaved", SPEC.swiglu_limit)
    assert rel_l2(out.float(), ref) < 0.01


@pytest.mark.parametrize("quant, wire, combine", [("bf16", "bf16", "bf16"), ("a4w4", "fp4", "fp8_blockwise_1x32"), ("a8w4", "fp8", "bf16")])
def test_nan_and_inf_rows_stay_in_their_token(quant, wire, combine) -> None:
    layer, p = layer_for(quant, wire, combine)
    clean = layer(p.x, p.topk_ids, p.topk_weights)
    x = p.x.clone()
    x[4, 7] = float("nan")
    x[9, :] = float("inf")
    out = layer(x, p.topk_ids, p.topk_weights)
    assert not torch.isfinite(out[4]).all() and not torch.isfinite(out[9]).all()
    others = [i for i in range(x.shape[0]) if i not in (4, 9)]
    assert torch.equal(out[others], clean[others])


def test_capacity_exceeded_is_an_error_not_a_drop() -> None:
    layer, p = layer_for("bf16", mtpr=32)
    with pytest.raises(PeerInputError, match="MEGA_MAX_TOKENS_PER_RANK=32"):
        layer(p.x, p.topk_ids, p.topk_weights)  # 48 tokens > 32


@pytest.mark.parametrize("bad", [16, 99, -2])
def test_expert_id_out_of_range(bad) -> None:
    layer, p = layer_for("bf16")
    ids = p.topk_ids.clone()
    ids[2, 1] = bad
    with pytest.raises(PeerInputError, match="topk_ids"):
        layer(p.x, ids, p.topk_weights)


def test_wrong_shapes_name_the_tensor() -> None:
    layer, p = layer_for("bf16")
    with pytest.raises(PeerInputError, match="hidden_states"):
        layer(p.x[:, :128], p.topk_ids, p.topk_weights)
    with pytest.raises(PeerInputError, match="topk_ids"):
        layer(p.x, p.topk_ids[:, :2], p.topk_weights)


def test_zero_tokens() -> None:
    layer, p = layer_for("a4w4", "fp4")
    out = layer(p.x[:0], p.topk_ids[:0], p.topk_weights[:0])
    assert out.shape == (0, SPEC.hidden_size)


def test_weights_must_match_plan() -> None:
    p = make_problem(ProblemConfig(SPEC, 4, 1))
    plan = build_plan(SPEC, Knobs(), 0, 2)
    with pytest.raises(ValueError, match="ep_rank 0 owns 8"):
        MegaMoELayer(plan, p.expert_weights("bf16"))


def test_transport_cache_keys_on_layout_and_wire() -> None:
    from megamoe_backend.transport import clear_transport_cache

    clear_transport_cache()
    a, p = layer_for("a4w4", "fp4")
    b, _ = layer_for("a4w4", "fp4", problem=p)
    c, _ = layer_for("a4w4", "bf16", problem=p)
    d, _ = layer_for("a4w4", "fp4", combine="fp8_blockwise_1x32", problem=p)
    assert a.transport is b.transport
    assert len({id(a.transport), id(c.transport), id(d.transport)}) == 3


def test_output_scale_is_applied_in_fp32_before_rounding() -> None:
    """output_scale multiplies the fp32 top-k sum, and the output is rounded to bf16 once: its bits are
    ``(fp32_sum * 2.5).bfloat16()``. fp32_sum is rebuilt outside the layer: the reference experts' rows
    for every live (token, k) pair, through the plan's combine wire, summed over k in fp32 (its bf16
    rounding is the unscaled layer's output, bit for bit, which pins the rebuild).

    Planted mutation, run once (tree 2377c6c + this test): the torch forward rounding to bf16 before
    scaling (``(summed.to(torch.bfloat16) * output_scale).to(torch.bfloat16)`` in
    layer/forwards/torch_path.py) fails the second assert (2.5 x a bf16 needs more than bf16's 8 bits);
    the assert_close(rtol=8e-3) this replaces passed that mutant bit for bit.
    """
    layer, p = layer_for("bf16")
    plan, hidden = layer.plan, SPEC.hidden_size
    plain = layer(p.x, p.topk_ids, p.topk_weights)
    scaled = layer(p.x, p.topk_ids, p.topk_weights, output_scale=2.5)
    token, k = (p.topk_ids >= 0).nonzero(as_tuple=True)  # ep_size 1, no replicas: physical id = local slot
    pairs = ExpertPairs(token, p.topk_ids[token, k].to(torch.int64), p.topk_weights[token, k].float())
    wire_rows = TorchReferenceExperts().forward_wire(p.x, pairs, layer.weights, plan.math, plan.combine)
    per_topk = torch.zeros(*p.topk_ids.shape, hidden, dtype=torch.float32)
    per_topk[token, k] = plan.combine.decode_fp32(wire_rows, hidden)
    fp32_sum = per_topk.sum(dim=1)
    assert torch.equal(plain.view(torch.int16), fp32_sum.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(scaled.view(torch.int16), (fp32_sum * 2.5).to(torch.bfloat16).view(torch.int16))


class _WireSpy(TorchReferenceExperts):
    """Records what the layer asks forward_wire for, and returns the rows times 2 (exact in every
    wire: a power of two), so a layer that did not use these rows would not double its output."""

    def __init__(self) -> None:
        super().__init__()
        self.wires: list[str] = []

    def forward_wire(self, a, pairs, weights, math, wire):
        self.wires.append(wire.name)
        return wire.encode(2 * self.forward(a, pairs, weights, math))


@pytest.mark.parametrize("combine", ["bf16", "fp8_blockwise_1x32"])
def test_layer_takes_combine_rows_from_forward_wire(combine) -> None:
    """The layer gets its combine wire rows from provider.forward_wire (Triton writes them in GEMM2's
    epilogue) with the plan's combine wire, and sends exactly those rows back."""
    plain, p = layer_for("a8w4", "fp8", combine)
    spy = _WireSpy()
    spied = MegaMoELayer(plain.plan, p.expert_weights("a8w4"), provider=spy)
    out = spied(p.x, p.topk_ids, p.topk_weights)
    assert spy.wires == [combine]
    assert torch.equal(out.float(), 2 * plain(p.x, p.topk_ids, p.topk_weights).float())


@pytest.mark.parametrize("quant", ["bf16", "a4w4"])
def test_in_place_expert_moves_are_seen_by_the_next_forward(quant) -> None:
    """What EPLB does to a layer: copy other experts' rows into its expert tensors in place. The
    tensors the layer hands out are its own (no copy), and nothing derived from them goes stale."""
    layer, p = layer_for(quant)
    tensors = layer.expert_tensors()
    assert tensors["w1"] is layer.weights.w1 and all(t.is_contiguous() for t in tensors.values())
    assert set(tensors) == ({"w1", "w2"} if quant == "bf16" else {"w1", "w2", "w1_scale", "w2_scale"})
    before = layer(p.x, p.topk_ids, p.topk_weights)
    # slot s now holds logical expert perm[s] (what an engine's rearrangement leaves behind)
    perm = torch.roll(torch.arange(SPEC.n_routed_experts), 3)
    originals = {name: t.clone() for name, t in tensors.items()}
    for name, t in tensors.items():
        rows = t.view(t.shape[0], -1)  # exactly the [local_experts, -1] view vLLM's EPLB moves
        for slot, logical in enumerate(perm.tolist()):
            rows[slot].copy_(originals[name].view(t.shape[0], -1)[logical])
    inverse = torch.argsort(perm)  # logical -> the slot holding it now
    moved_ids = torch.where(p.topk_ids >= 0, inverse[p.topk_ids.clamp_min(0)], p.topk_ids)
    assert torch.equal(layer(p.x, moved_ids, p.topk_weights), before)
    assert not torch.equal(layer(p.x, p.topk_ids, p.topk_weights), before)  # the old ids now reach other experts
