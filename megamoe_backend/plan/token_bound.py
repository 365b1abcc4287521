"""The token bound an engine passes to ``MegaMoELayer.forward(max_tokens_across_ranks=...)``.

Why: the device P2P forward sizes its receive regions and expert grids by the most tokens any EP
rank brings to the step. Without a bound that is MEGA_MAX_TOKENS_PER_RANK (8192), so a decode step
of 8 tokens per rank pays for 8192 (issue 32: 9.4x at EP 8). The engines already hold the
DP-synchronised batch sizes as Python ints (vLLM's ``DPMetadata``, SGLang's
``get_dp_global_num_tokens()``); this module turns them into the one number every EP rank passes.

Rules the layer states (``MegaMoELayer.forward``): tokens on this rank <= bound <=
MEGA_MAX_TOKENS_PER_RANK, and the SAME on every EP rank. The bound is rounded up to a power of two
so a handful of values (and tile configs) serve every step, as vLLM's DeepEP path does under CUDA
graphs; it is computed from per-DP-rank counts every rank holds, never from this rank's own batch.

Every EP forward takes the bound (the forward oracle's ``takes_token_bound``, plan/forward_choice.py): the device P2P forward sizes its receive
regions and tile config by it and its barrier compares every rank's number; the torch forward
(gloo / NCCL / mori transports) sizes nothing by it but checks both rules, the second
through its dispatch header, which carries every rank's bound next to its status
(transport/bound_header.py). So the engines pass the bound on every EP deployment, CPU included, and a
CPU engine run shows the number the GPU forward would get, checked by a forward that uses it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

def takes_token_bound(layer: Any) -> bool:
    """Whether ``layer.forward`` takes ``max_tokens_across_ranks``, as the forward oracle answered it
    for that layer (``layer.forward_choice``, plan/forward_choice.py): every forward that exchanges
    rows and aiter's fused runtime, not the ep_size-1 device forward. The one place the plugins ask
    this; an object with no forward choice (an engine test's stand-in runtime) takes none."""
    choice = getattr(layer, "forward_choice", None)
    return choice is not None and choice.takes_token_bound


def tokens_per_ep_rank(tokens_per_dp_rank: Iterable[int], split: int) -> int:
    """The most tokens one EP rank sends when each DP rank's batch is split over ``split`` ranks
    (TP / attention-TP slices; a slice of ``n`` tokens over ``split`` ranks is at most ceil(n / split))."""
    if split < 1:
        raise ValueError(f"split={split} must be >= 1")
    return max((-(-int(n) // split) for n in tokens_per_dp_rank), default=0)


def token_bound(max_tokens_per_rank: int, capacity: int) -> int:
    """``max_tokens_per_rank`` rounded up to a power of two, capped at ``capacity`` (the layer's
    MEGA_MAX_TOKENS_PER_RANK), at least 1 (a step where every rank is idle still runs the barriers)."""
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1")
    n = max(int(max_tokens_per_rank), 1)
    return min(1 << (n - 1).bit_length(), capacity)


def bound_kwargs(layer: Any, bound: Callable[[], int | None]) -> dict[str, int]:
    """``{"max_tokens_across_ranks": bound()}`` where ``layer`` takes the bound, else ``{}``.

    ``bound`` is the engine's reader (Python ints it already holds; None: no bound known this step,
    so MEGA_MAX_TOKENS_PER_RANK on every rank). It is called only for the device P2P forward.
    """
    if not takes_token_bound(layer):
        return {}
    n = bound()
    return {} if n is None else {"max_tokens_across_ranks": n}


def bound_problem(tokens: int, bound: int | None, capacity: int) -> str:
    """What is wrong with ``bound`` for a forward that brings ``tokens`` on this rank, or "" (no
    bound is never wrong): the layer's rule tokens <= bound <= ``capacity`` (MEGA_MAX_TOKENS_PER_RANK),
    bound >= 1. Both EP forwards ask it before anything moves."""
    if bound is None or (bound >= 1 and tokens <= bound <= capacity):
        return ""
    return (f"max_tokens_across_ranks={bound} must lie in [tokens on this rank ({tokens}), MEGA_MAX_TOKENS_PER_RANK="
            f"{capacity}] and be >= 1; no token was dropped")
