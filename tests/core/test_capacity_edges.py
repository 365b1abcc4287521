"""The off-by-one edges of the two capacity rules every forward asks before anything moves (issue 59):
tokens on a rank <= MEGA_MAX_TOKENS_PER_RANK (layer/forwards/base.py ``shape_status``) and
tokens <= max_tokens_across_ranks <= MEGA_MAX_TOKENS_PER_RANK (plan/token_bound.py ``bound_problem``; on
the P2P path the bound sizes the receive rows, so one token over it is a row written past them).

Both rules were only ever tried far from the edge, so ``t > mtpr + 1`` and ``tokens - 1 <= bound``
survived every test. Here each is tried at the edge, on the forward a CPU engine runs (the torch forward
of a single-process layer) and on the functions themselves. Planted mutations (run, then restored):
``t > plan.mtpr + 1`` at base.py:49 fails test_one_token_over_mtpr_is_refused; ``tokens - 1 <= bound``
at token_bound.py:74 fails test_a_bound_one_below_the_tokens_is_refused.
"""

from __future__ import annotations

import pytest
import torch

from megamoe_backend.knobs import Knobs
from megamoe_backend.layer import MegaMoELayer
from megamoe_backend.plan import build_plan
from megamoe_backend.plan.token_bound import bound_problem
from megamoe_backend.spec import preset
from megamoe_backend.transport import PeerInputError
from megamoe_backend.workload import ProblemConfig, make_problem

SPEC = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=64, n_routed_experts=8)
MTPR = 4


@pytest.fixture(scope="module")
def layer_and_problem():
    problem = make_problem(ProblemConfig(SPEC, MTPR + 1, 1, seed=3))
    layer = MegaMoELayer(build_plan(SPEC, Knobs(max_tokens_per_rank=MTPR)), problem.expert_weights("bf16"))
    return layer, problem


def _first(problem, t: int):
    return problem.x[:t], problem.topk_ids[:t], problem.topk_weights[:t]


def test_one_token_over_mtpr_is_refused(layer_and_problem):
    layer, problem = layer_and_problem
    assert layer(*_first(problem, MTPR)).shape == (MTPR, SPEC.hidden_size)  # exactly MTPR: served
    with pytest.raises(PeerInputError, match=f"{MTPR + 1} tokens on ep_rank 0 exceed MEGA_MAX_TOKENS_PER_RANK={MTPR}"):
        layer(*_first(problem, MTPR + 1))
    status, message = layer.path.shape_status(*_first(problem, MTPR + 1))
    assert status == 1 and "no token was dropped" in message
    assert layer.path.shape_status(*_first(problem, MTPR)) == (0, "")


def test_a_bound_one_below_the_tokens_is_refused(layer_and_problem):
    layer, problem = layer_and_problem
    x, ids, w = _first(problem, 3)
    assert layer(x, ids, w, max_tokens_across_ranks=3).shape == (3, SPEC.hidden_size)  # bound == tokens: served
    with pytest.raises(PeerInputError, match=r"max_tokens_across_ranks=2 must lie in \[tokens on this rank \(3\), "):
        layer(x, ids, w, max_tokens_across_ranks=2)
    assert bound_problem(3, 3, MTPR) == "" and bound_problem(3, MTPR, MTPR) == ""
    assert bound_problem(3, 2, MTPR) and bound_problem(3, MTPR + 1, MTPR) and bound_problem(0, 0, MTPR)
