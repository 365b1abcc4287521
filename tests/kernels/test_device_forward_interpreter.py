"""The sync-free device forward (layer/device/) under the Triton interpreter, on CPU, small shapes.

Checked here: the route kernel and the top-k sum kernel against their torch references (bit for
bit, masked and bad ids, both combine wires, output_scale, the status word), and the whole device
forward of MegaMoELayer against the torch forward with the same Triton experts: bit-identical for
every quant x dispatch wire x combine wire, within the accuracy gates vs fp32, bad ids and NaN rows
reported at the next forward, T > MTPR refused from shapes, the empty batch. CUDA-graph capture,
sync-debug mode and timing need a GPU: tests/kernels/test_gpu_layer.py.
"""

from __future__ import annotations

import pytest
import torch

from interpreter_guard import require_interpreter  # noqa: E402

require_interpreter("tests/kernels/test_gpu_layer.py")

from megamoe_backend.experts.triton import TritonExperts  # noqa: E402
from megamoe_backend.formats import combine_wire  # noqa: E402
from megamoe_backend.knobs import Knobs  # noqa: E402
from megamoe_backend.layer import MegaMoELayer, fp32_reference_moe, rel_l2  # noqa: E402
from megamoe_backend.layer.device.route import route_pairs, route_pairs_torch  # noqa: E402
from megamoe_backend.layer.device.status import BAD_EXPERT_ID, NONFINITE_ROW, InputStatus  # noqa: E402
from megamoe_backend.layer.device.topk_sum import topk_sum, topk_sum_torch  # noqa: E402
from megamoe_backend.plan import build_plan  # noqa: E402
from megamoe_backend.transport import PeerInputError, clear_transport_cache  # noqa: E402
from megamoe_backend.workload import ProblemConfig, make_problem  # noqa: E402

from quantised_twin import assert_rows_near, torch_emulated_layer  # noqa: E402
from small_layer import GATES, K, SPEC, fresh_transport_cache  # noqa: E402, F401 (the fixture is autouse)



# ------------------------------------------------------------------------------------ kernels
def test_route_kernel_equals_torch_and_reports_the_first_bad_id() -> None:
    g = torch.Generator().manual_seed(0)
    t, num_physical = 37, 8
    ids = torch.randint(-1, num_physical, (t, K), generator=g)
    weights = torch.rand(t, K, generator=g)
    owner = torch.tensor([0, 0, 1, 1, 0, 1, 0, 1])
    slot = torch.tensor([0, 1, 0, 1, 2, 2, 3, 3])
    for rank in (0, 1):
        for bad_value, where in ((None, None), (8, (5, 2)), (-7, (30, 0))):
            case = ids.clone()
            if bad_value is not None:
                case[where] = bad_value
            status = InputStatus(torch.device("cpu"), num_physical)
            pair_slot = torch.full((t * K,), 123, dtype=torch.int64)
            pair_weight = torch.full((t * K,), 9.0)
            route_pairs(case, weights, owner, slot, rank, pair_slot, pair_weight, status.word, layer_id=3)
            ref_slot, ref_weight, first_bad = route_pairs_torch(case, weights, owner, slot, rank)
            assert torch.equal(pair_slot, ref_slot) and torch.equal(pair_weight, ref_weight)
            if bad_value is None:
                assert status.word.tolist() == [0, 0, 0, 0]
            else:
                assert first_bad == bad_value
                assert status.word.tolist() == [BAD_EXPERT_ID, 3, bad_value, where[0]]
                assert int(pair_slot[where[0] * K + where[1]]) == -1  # the bad entry runs nowhere


@pytest.mark.parametrize("wire_name", ["bf16", "fp8_blockwise_1x32"])
@pytest.mark.parametrize("output_scale", [1.0, 2.5])
def test_topk_sum_equals_the_zero_filled_torch_sum(wire_name, output_scale) -> None:
    g = torch.Generator().manual_seed(1)
    t, hidden = 19, 1024 + 64  # two column blocks, the second partial
    wire = combine_wire(wire_name)
    values = torch.randn(t * K, hidden, generator=g) * torch.logspace(-3, 3, t * K).unsqueeze(1)
    rows = wire.encode(values)
    pair_slot = torch.randint(-1, 4, (t * K,), generator=g)
    rows[pair_slot < 0] = 0xFF  # rows that were never written: garbage (NaN bytes), must not be read
    decoded = wire.decode_fp32(rows, hidden)
    status = InputStatus(torch.device("cpu"), 8)
    out = torch.empty(t, hidden, dtype=torch.bfloat16)
    topk_sum(rows, pair_slot, out, wire.mx, hidden, K, status.word, layer_id=0, output_scale=output_scale)
    assert torch.equal(out.view(torch.int16), topk_sum_torch(decoded, pair_slot, K, output_scale).view(torch.int16))
    assert status.word.tolist() == [0, 0, 0, 0]


def test_topk_sum_reports_a_nonfinite_row() -> None:
    t, hidden = 4, 64
    wire = combine_wire("bf16")
    values = torch.ones(t * K, hidden)
    values[2 * K + 1, 7] = float("nan")
    status = InputStatus(torch.device("cpu"), 8)
    out = torch.empty(t, hidden, dtype=torch.bfloat16)
    topk_sum(wire.encode(values), torch.zeros(t * K, dtype=torch.int64), out, None, hidden, K, status.word, layer_id=1)
    assert status.word.tolist() == [NONFINITE_ROW, 1, 0, 2]
    assert torch.isnan(out[2, 7]) and torch.isfinite(out[[0, 1, 3]]).all()


# ------------------------------------------------------------------------------------- layer
def layers(quant, wire, combine, mtpr=64, tokens=5, masked=0.2, seed=3):
    problem = make_problem(ProblemConfig(SPEC, tokens, 1, seed=seed, masked_fraction=masked))
    plan = build_plan(SPEC, Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=mtpr), quant=quant)
    weights = problem.expert_weights(quant)
    device = MegaMoELayer(plan, weights, provider=TritonExperts(capacity=mtpr * K), device_path=True)
    torch_path = MegaMoELayer(plan, weights, provider=TritonExperts(capacity=mtpr * K), device_path=False)
    return device, torch_path, problem


CASES = [("bf16", "bf16", "bf16"), ("a8w4", "fp8", "fp8_blockwise_1x32"), ("a4w4", "fp4", "bf16"), ("a8w4", "bf16", "bf16")]


@pytest.mark.parametrize("quant, wire, combine", CASES)
def test_device_forward_equals_torch_forward_bit_for_bit(quant, wire, combine) -> None:
    device, torch_path, p = layers(quant, wire, combine)
    assert device.workspace is not None and torch_path.workspace is None
    got = device(p.x, p.topk_ids, p.topk_weights)
    assert torch.equal(got.view(torch.int16), torch_path(p.x, p.topk_ids, p.topk_weights).view(torch.int16))
    ref = fp32_reference_moe(p.x, p.topk_ids, p.topk_weights, *p.expert_weights(quant).dequantized(), "interleaved",
                             SPEC.swiglu_limit)
    assert rel_l2(got.float(), ref) < GATES[quant]


@pytest.mark.parametrize("quant, wire, combine", CASES)
def test_device_forward_rows_stay_near_the_torch_emulated_quantised_layer(quant, wire, combine) -> None:
    """The CPU twin of test_gpu_layer.py's check: every output row of the device forward (Triton
    experts) within quantised_twin.ROW_TOL of the torch-emulated quantised layer (same plan, reference
    experts); measured here: 0.0 on every row of every case (the interpreter's fp32 dot at K = 128).
    Planted mutations, each run once (tree 2377c6c + issue 46's split, this test), each failing here:
    output x1.05 (gemm2._gemm2_store: route weight x 1.05; bf16 case, worst row 5.1e-2), a wrong scale
    exponent (gather._rowscale_row: the last 32-block of every frag8 A / A2 row read one binade high;
    a8w4 case, 1.7), a dropped pair (layer/device/route.py: (token 1, k 0) given no slot; bf16, 0.45)."""
    device, _, p = layers(quant, wire, combine, tokens=8)
    twin = torch_emulated_layer(device, p.expert_weights(quant), "cpu")
    got = device(p.x, p.topk_ids, p.topk_weights)
    assert_rows_near(got, twin(p.x, p.topk_ids, p.topk_weights), f"{quant}/{wire}/{combine}", combine)


def test_layers_of_one_shape_share_one_workspace() -> None:
    a, _, p = layers("a8w4", "fp8", "bf16")
    b = MegaMoELayer(a.plan, p.expert_weights("a8w4"), provider=TritonExperts(capacity=64 * K), device_path=True, name="b")
    assert a.workspace is b.workspace
    assert a.workspace.combine_rows.shape == (64 * K, combine_wire("bf16").row_bytes(SPEC.hidden_size))


def test_bad_id_contributes_nothing_and_is_raised_at_the_next_forward() -> None:
    device, _, p = layers("bf16", "bf16", "bf16", masked=0.0)  # the route kernel does not depend on the quant
    ids = p.topk_ids.clone()
    ids[4, 1] = 8  # one past the last physical expert
    got = device(p.x, ids, p.topk_weights)  # reported through the status word, not raised here
    masked = ids.clone()
    masked[4, 1] = -1
    with pytest.raises(ValueError, match=r"layer 0: topk_ids holds 8 at token 4; valid are -1 \(masked\) and 0..7"):
        device(p.x, masked, p.topk_weights)
    assert torch.equal(got.view(torch.int16), device(p.x, masked, p.topk_weights).view(torch.int16))
    assert device.workspace.status.word.tolist() == [0, 0, 0, 0]  # cleared: forwards go on


@pytest.mark.parametrize("quant, wire, message", [
    ("bf16", "bf16", r"output row 2 is not finite \(NaN/Inf in hidden_states row 2"),  # seen in the top-k sum
    ("a8w4", "bf16", r"hidden_states row 2 holds NaN/Inf \(found while quantising it\)"),  # seen by the quantiser
])
def test_nan_row_only_touches_itself_and_is_raised_at_the_next_forward(quant, wire, message) -> None:
    device, _, p = layers(quant, wire, "bf16", masked=0.0)
    x = p.x.clone()
    x[2] = float("nan")
    got = device(x, p.topk_ids, p.topk_weights)
    with pytest.raises(ValueError, match=message):
        device(p.x, p.topk_ids, p.topk_weights)
    ref = device(p.x, p.topk_ids, p.topk_weights)
    keep = torch.arange(x.shape[0]) != 2
    assert torch.equal(got[keep].view(torch.int16), ref[keep].view(torch.int16))


def test_shape_checks_need_no_data() -> None:
    device, _, p = layers("bf16", "bf16", "bf16", mtpr=4, tokens=6)
    with pytest.raises(PeerInputError, match="exceed MEGA_MAX_TOKENS_PER_RANK=4; .* no token was dropped"):
        device(p.x, p.topk_ids, p.topk_weights)
    with pytest.raises(ValueError, match=r"topk_ids / topk_weights must be \[3, 6\]"):
        device(p.x[:3], p.topk_ids[:2], p.topk_weights[:3])
    with pytest.raises(ValueError, match="hidden_states must be"):
        device(p.x[:3, :64], p.topk_ids[:3], p.topk_weights[:3])
    empty = device(p.x[:0], p.topk_ids[:0], p.topk_weights[:0])
    assert empty.shape == (0, SPEC.hidden_size) and empty.dtype == torch.bfloat16


def test_all_masked_batch_is_zero() -> None:
    device, _, p = layers("a4w4", "fp4", "fp8_blockwise_1x32", masked=0.0)
    out = device(p.x, torch.full_like(p.topk_ids, -1), p.topk_weights)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("quant, wire", [("bf16", "bf16"), ("a8w4", "fp8"), ("a4w4", "fp4")])
def test_a_nan_row_that_routes_nowhere_is_not_bad_input(quant, wire) -> None:
    """An engine's padded rows (vLLM's captured batches) hold whatever attention left there, NaN
    included; their route ids are -1 (the plugins mask them), so they reach no expert. Such a row is
    neither quantised nor reported (the P2P dispatch skips it likewise); its output row is zero and
    the other rows keep their bits. Seen on an H100 inside vLLM 0.34 with FULL decode graphs: without
    this, the quantiser reported the padded row 3 of a 3-request batch and the engine stopped."""
    device, _, p = layers(quant, wire, "bf16", masked=0.0)
    x, ids = p.x.clone(), p.topk_ids.clone()
    x[3], ids[3] = float("nan"), -1
    got = device(x, ids, p.topk_weights)
    device.raise_if_bad_input()  # nothing was recorded
    assert torch.count_nonzero(got[3]) == 0
    clean = p.x.clone()
    clean[3] = 0.0
    ref = device(clean, ids, p.topk_weights)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
