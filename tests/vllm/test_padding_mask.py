"""Padded rows of vLLM's batch reach no expert (megamoe_vllm/padding.py), through the plugin's op body.

vLLM 0.34 marks padded rows in ``ForwardContext.is_padding``; the op body turns their route ids
into -1 before the layer sees them. Checked here with the plugin's own ``forward_tokens`` over a
real CPU ``MegaMoELayer`` and an injected forward context (the GPU engine test counts the same on
the device inside vLLM's captured graphs: tests/gpu_engine).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megamoe_backend.knobs import Knobs
from megamoe_backend.layer import MegaMoELayer
from megamoe_backend.plan import build_plan
from megamoe_backend.spec import MoESpec
from megamoe_backend.workload import ProblemConfig, make_problem
from megamoe_vllm import padding as padding_mod
from megamoe_vllm.method import MegaMoEMethod
from megamoe_vllm.padding import PaddedIds

SPEC = MoESpec(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, quant="bf16")


@pytest.fixture
def forward_context(monkeypatch):
    """Install a vLLM forward context holding ``is_padding`` (None: a vLLM that sets none)."""
    import vllm.forward_context as fc

    def install(mask):
        ctx = SimpleNamespace(dp_metadata=None)
        if mask is not None:
            ctx.is_padding = mask
        monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
        monkeypatch.setattr(fc, "get_forward_context", lambda: ctx)

    return install


@pytest.fixture(autouse=True)
def _one_tp_rank(monkeypatch):
    import megamoe_vllm.method as method_mod

    monkeypatch.setattr(method_mod, "_tp_position", lambda: (1, 0))  # no vLLM parallel groups in this process


def _method(problem):
    plan = build_plan(SPEC, Knobs(max_tokens_per_rank=16), quant="bf16")
    method = object.__new__(MegaMoEMethod)  # the op body's state, without vLLM's layer around it
    method.runtime = MegaMoELayer(plan, problem.expert_weights("bf16"), device="cpu")
    method.plan, method.sequence_parallel = method.runtime.plan, False
    method.moe = SimpleNamespace(dp_size=1)
    method.padded_ids = PaddedIds(plan.mtpr, SPEC.num_experts_per_tok, "cpu")
    return method


def test_padded_rows_reach_no_expert_and_real_rows_are_unchanged(forward_context):
    problem = make_problem(ProblemConfig(SPEC, 6, 1, seed=5))
    method = _method(problem)
    x, ids, w = problem.x, problem.topk_ids, problem.topk_weights
    forward_context(None)
    plain = method.forward_tokens(x, ids, w)
    pad = torch.tensor([False, False, False, False, True, True])
    forward_context(pad)
    seen = []
    inner = method.runtime.forward
    method.runtime.forward = lambda x_, ids_, w_, **kw: seen.append(ids_.clone()) or inner(x_, ids_, w_, **kw)
    masked = method.forward_tokens(x, ids, w)
    assert torch.equal(seen[0][4:], torch.full_like(ids[4:], -1))  # the layer got no expert for padded rows
    assert torch.equal(seen[0][:4], ids[:4])
    assert torch.equal(masked[:4], plain[:4])  # real rows: the same bits
    assert torch.count_nonzero(masked[4:]) == 0 and torch.count_nonzero(plain[4:]) > 0


def test_padded_ids_write_into_their_buffer_and_refuse_what_does_not_fit():
    padded = PaddedIds(8, 2, "cpu")
    ids = torch.tensor([[1, 2], [3, 0], [2, 1]], dtype=torch.int32)
    out = padded.apply(ids, torch.tensor([False, True, False]))
    assert out.data_ptr() == padded.buffers[torch.int32].data_ptr()  # no allocation per call
    assert out.tolist() == [[1, 2], [-1, -1], [2, 1]]
    assert padded.apply(ids, None) is ids
    with pytest.raises(ValueError, match="does not fit the padded-id buffers"):
        padded.apply(torch.zeros(9, 2, dtype=torch.int32), torch.zeros(9, dtype=torch.bool))


def test_no_mask_without_vllms_padding_field(forward_context):
    forward_context(None)  # vLLM 0.32 / 0.33: ForwardContext has no is_padding
    assert padding_mod.padding_rows(4) is None
    forward_context(torch.tensor([False, True]))  # shorter than the batch: not this batch's mask
    assert padding_mod.padding_rows(4) is None
    forward_context(torch.tensor([False, True, False, False, True]))
    assert padding_mod.padding_rows(4).tolist() == [False, True, False, False]
