"""The ``max_tokens_across_ranks`` vLLM's MoE op passes to the device P2P forward.

Where vLLM holds the number: inside a forward, ``get_forward_context().dp_metadata`` (set when
data_parallel_size > 1 or sequence-parallel MoE is on). Its per-DP-rank token counts come from the
DP all-reduce (``coordinate_batch_across_dp``), so every rank holds the same list; under CUDA graphs
every DP rank's batch is already padded to one size (v1/worker/dp_utils.py), and ``_dummy_run`` —
warm-up, profiling, idle DP ranks and graph capture — passes the same list. The runner's
``sp_local_sizes`` turns it into per-rank sizes after sequence-parallel slicing.

Why read it in the op body: the op runs eagerly even inside vLLM's compiled graph, so the ints are
read at run time (at capture for a captured graph, whose replays all have that padded size), never
frozen into a Dynamo trace.

Without DP metadata (dp_size 1, no sequence parallelism) the EP group is the TP group, whose ranks
all hold the same batch: this rank's own token count is then the same number on every EP rank.
With dp_size > 1 and no metadata (a forward vLLM ran without token counts) no rank can know the
others' batches: the bound is None there, i.e. MEGA_MAX_TOKENS_PER_RANK on every rank.
"""

from __future__ import annotations

from typing import Any

from megamoe_backend.plan.token_bound import token_bound, tokens_per_ep_rank


def dp_chunk_sizes(moe_config: Any) -> list[int] | None:
    """Per-rank token counts of this step across DP (x SP) ranks, or None without DP metadata."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    dp = get_forward_context().dp_metadata
    if dp is None:
        return None
    if dp.local_sizes is not None:  # inside the runner's sequence-parallel context (the usual case)
        return list(dp.get_chunk_sizes_across_dp_rank())
    with dp.sp_local_sizes(moe_config.sp_size, pcp_size=moe_config.pcp_size, use_ep=moe_config.use_ep) as sizes:
        return list(sizes)


def max_tokens_across_ranks(local_tokens: int, tp_split: int, moe_config: Any, capacity: int) -> int | None:
    """The bound for this step: the most tokens any EP rank sends (each DP rank's batch split over
    ``tp_split`` TP ranks), rounded up to a power of two, capped at ``capacity``."""
    sizes = dp_chunk_sizes(moe_config)
    if sizes is None:
        if moe_config.dp_size > 1:
            return None
        sizes = [local_tokens]
    return token_bound(tokens_per_ep_rank(sizes, tp_split), capacity)
