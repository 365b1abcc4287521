"""The token bound as the torch forward's dispatch header carries it, and the check that every EP rank
passed the same one.

Why in transport: the header is the transport's (transport/torch_dist.py, mori's reductions), and the
check runs inside its dispatch, where every rank reads the same header values. The bound's other rules
(tokens <= bound <= MEGA_MAX_TOKENS_PER_RANK, which forwards take it) live with the plan
(plan/token_bound.py), which the transports do not import.
"""

from __future__ import annotations

from typing import Sequence

NO_BOUND = 0  # what a header carries for a forward called without max_tokens_across_ranks (a bound is >= 1)


def bound_disagreement(bounds: Sequence[int], labels: Sequence[str] | None = None) -> str:
    """"" when every EP rank passed the same bound to this forward (``bounds[r]``: rank r's, as its
    dispatch header carries it, NO_BOUND for none), else the error every rank raises: each rank
    reads the same header values, so all of them refuse the step the same way (no rank waits).
    ``labels`` names the values where they are not per rank (mori's reduction: lowest, highest)."""
    if len(set(int(b) for b in bounds)) <= 1:
        return ""
    labels = labels or [f"ep_rank {r}" for r in range(len(bounds))]
    seen = ", ".join(f"{label}: {'none' if int(b) == NO_BOUND else int(b)}" for label, b in zip(labels, bounds))
    return (f"the EP ranks passed different max_tokens_across_ranks to the same forward ({seen}); every rank must pass "
            "the same number (the engine's DP-padded bound), or none on every rank; no token was dropped")
