"""The ``max_tokens_across_ranks`` SGLang's ``megamoe_ep`` runner passes to the device P2P forward.

Where SGLang holds the number: ``sglang.srt.layers.dp_attention.get_dp_global_num_tokens()``, the
per-DP-rank token counts of this forward, published by ``set_dp_buffer_len`` before the model runs
(eager: the scheduler's DP all-gather, ceil-aligned to the attention-TP size; graph capture:
``[graph batch] * num_dp_ranks``). The MoE input is scattered over the attention-TP ranks of each
DP group, so one EP rank sends at most ceil(count / attn_tp_size) tokens.

The list holds every DP rank's count only when ``require_mlp_tp_gather()`` is true; the plugin's
hook makes it true for megamoe_ep under DP attention (hooks.py), which also makes every DP rank
replay the graph of the largest rank's batch. Without a published list (no DP attention and no
gathered buffer) no rank knows the others' batches: the bound is None there, i.e.
MEGA_MAX_TOKENS_PER_RANK on every rank.
"""

from __future__ import annotations

from megamoe_backend.plan.token_bound import token_bound, tokens_per_ep_rank


def max_tokens_across_ranks(capacity: int) -> int | None:
    """The bound for this forward (a power of two <= ``capacity``), or None (see module doc)."""
    from sglang.srt.layers.dp_attention import get_dp_global_num_tokens
    from sglang.srt.runtime_context import get_parallel

    counts = get_dp_global_num_tokens()
    if not counts:
        return None
    return token_bound(tokens_per_ep_rank(counts, int(get_parallel().attn_tp_size)), capacity)
