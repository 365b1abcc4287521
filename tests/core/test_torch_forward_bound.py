"""``max_tokens_across_ranks`` on the torch forward (layer/forwards/torch_path.py), gloo rank processes.

The torch forward sizes nothing by the bound but holds the device P2P forward's rules, so an engine
run on CPU (which always takes this forward) checks the bound the engine would hand the GPU:
- a bound every rank shares changes nothing in the result (bit for bit the unbounded forward and
  the single-process layer), at the tightest value (the largest batch) and at a looser power of two;
- ranks that pass different bounds (or one passes none) all raise the same PeerInputError, which
  names every rank's number (the dispatch header carries it, as the P2P barrier compares B);
- a bound below this rank's tokens or above MEGA_MAX_TOKENS_PER_RANK is refused by name on that
  rank and as "ep_rank r: ..." on the others (status 4), nobody waits;
- after every refusal the group goes on: the next forward is correct on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megamoe_backend.knobs import Knobs
from megamoe_backend.layer import MegaMoELayer
from megamoe_backend.parallel import spawn_ranks
from megamoe_backend.plan import build_plan
from megamoe_backend.spec import preset
from megamoe_backend.transport import PeerInputError
from megamoe_backend.workload import ProblemConfig, local_weights, make_problem

pytestmark = pytest.mark.multiproc

SPEC = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=64, n_routed_experts=16)
MTPR = 16
TOKENS = (8, 3)  # rank 0 brings 8 tokens, rank 1 brings 3: the bound follows rank 0


def _bounds_worker(rank: int, world: int, cfg: ProblemConfig) -> dict:
    problem = make_problem(cfg)
    plan = build_plan(cfg.spec, Knobs(max_tokens_per_rank=MTPR), rank, world)
    layer = MegaMoELayer(plan, local_weights(problem.expert_weights("bf16"), plan.placement, rank), group=dist.group.WORLD)
    lo = rank * cfg.tokens_per_rank
    x, ids, w = (t[lo: lo + TOKENS[rank]] for t in (problem.x, problem.topk_ids, problem.topk_weights))

    def attempt(bound):
        try:
            return layer(x, ids, w, max_tokens_across_ranks=bound)
        except PeerInputError as exc:
            return f"PeerInputError: {exc}"

    return {
        "takes_token_bound": layer.takes_token_bound,
        "transport": layer.transport_name,
        "unbounded": layer(x, ids, w),
        "tight": attempt(8),
        "loose": attempt(16),
        "disagree": attempt((8, 16)[rank]),
        "none_here": attempt((None, 8)[rank]),
        "after_disagree": attempt(8),
        "below_tokens": attempt(4),  # rank 0 brings 8 tokens
        "above_mtpr": attempt((MTPR + 16, 16)[rank]),
        "zero": attempt((8, 0)[rank]),
        "again": attempt(8),
    }


@pytest.fixture(scope="module")
def ranks():
    cfg = ProblemConfig(SPEC, max(TOKENS), 2, seed=7, masked_fraction=0.1)
    results = spawn_ranks(2, _bounds_worker, cfg, timeout_s=300)
    problem = make_problem(cfg)
    keep = torch.cat([torch.arange(r * cfg.tokens_per_rank, r * cfg.tokens_per_rank + TOKENS[r]) for r in range(2)])
    local = MegaMoELayer(build_plan(SPEC, Knobs()), problem.expert_weights("bf16"))
    return results, local(problem.x[keep], problem.topk_ids[keep], problem.topk_weights[keep])


def test_the_torch_forward_takes_the_bound_and_a_shared_one_changes_no_bit(ranks):
    results, local = ranks
    assert all(r["takes_token_bound"] and r["transport"] == "gloo" for r in results)
    unbounded = torch.cat([r["unbounded"] for r in results])
    assert torch.equal(unbounded, local)
    for key in ("tight", "loose", "after_disagree", "again"):
        assert all(isinstance(r[key], torch.Tensor) for r in results), [r[key] for r in results]
        assert torch.equal(torch.cat([r[key] for r in results]), local), key


def test_ranks_that_disagree_all_raise_the_same_error_naming_every_rank(ranks):
    results, _ = ranks
    first, second = (r["disagree"] for r in results)
    assert first == second, (first, second)
    assert "different max_tokens_across_ranks" in first and "(ep_rank 0: 8, ep_rank 1: 16)" in first
    first, second = (r["none_here"] for r in results)
    assert first == second and "(ep_rank 0: none, ep_rank 1: 8)" in first, first


def test_a_bound_out_of_range_is_refused_by_name_on_its_rank_and_on_every_peer(ranks):
    results, _ = ranks
    r0, r1 = results
    # below this rank's tokens: rank 0 (8 tokens) names the number, rank 1 names rank 0
    assert "max_tokens_across_ranks=4 must lie in [tokens on this rank (8), MEGA_MAX_TOKENS_PER_RANK=16]" in r0["below_tokens"]
    assert r1["below_tokens"].startswith("PeerInputError: [megamoe] dispatch refused on every rank because of bad input "
                                         "(ep_rank 0: max_tokens_across_ranks out of"), r1["below_tokens"]
    assert "max_tokens_across_ranks=32 must lie in [tokens on this rank (8), MEGA_MAX_TOKENS_PER_RANK=16]" in r0["above_mtpr"]
    assert "ep_rank 0: max_tokens_across_ranks out of" in r1["above_mtpr"]
    assert "max_tokens_across_ranks=0 must lie in [tokens on this rank (3)" in r1["zero"] and "be >= 1" in r1["zero"]
    assert "ep_rank 1: max_tokens_across_ranks out of" in r0["zero"]
