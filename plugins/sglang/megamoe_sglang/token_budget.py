"""Start-up check: the most tokens one forward can bring to an EP rank vs MEGA_MAX_TOKENS_PER_RANK.

Why at start-up: a forward with more tokens on one rank than MEGA_MAX_TOKENS_PER_RANK is refused by
that rank's layer alone, and its peers then wait MEGA_P2P_TIMEOUT_S before they break too. The
server arguments bound every forward, so the launcher can refuse the deployment before any process
starts, naming both numbers and the flags to change (the vLLM plugin checks
--max-num-batched-tokens the same way).

What bounds one forward on one DP rank, after SGLang's resolution (``--chunked-prefill-size`` is
then already per DP rank: ``handle_data_parallelism`` divides it by ``--attn-dp-size``):
- a prefill chunk: ``--chunked-prefill-size`` (no chunking: only the prompt length bounds it);
- a prefill CUDA graph: its largest batch, in tokens (``--cuda-graph-max-bs-prefill``);
- a decode / verify step: requests x tokens per request, the requests bounded by the largest decode
  graph (``--cuda-graph-max-bs-decode``) and, for eager steps, by ``--max-running-requests`` / DP
  ranks; tokens per request are the speculative draft tokens (``--speculative-num-draft-tokens``).
  Without ``--max-running-requests`` SGLang sizes the request pool from free memory after start-up;
  eager decode steps beyond the largest graph are then bounded only by the layer's own check.
The MoE input of a DP rank is scattered over its attention-TP ranks (tp / attn-dp), as the token
bound assumes (dp_bound.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from megamoe_backend.plan.token_bound import tokens_per_ep_rank

from .selection import BACKEND_NAME, MegaMoEConfigError

RESOLUTION_STEP = "validate_mega_moe_token_budget_for_model"  # SGLang's own MegaMoE budget step


@dataclass(frozen=True)
class TokenBudget:
    """Tokens per DP rank of the largest forward of each kind (0: that kind never runs), and the
    attention-TP ranks each DP rank's batch is scattered over."""

    prefill_chunk: int
    prefill_graph: int
    decode_requests: int
    tokens_per_request: int
    attn_tp_size: int
    decode_requests_flag: str = "--cuda-graph-max-bs-decode"

    def per_rank(self) -> dict[str, int]:
        """Tokens one EP rank receives from this rank's batch, for each kind of forward."""
        kinds = {
            "--chunked-prefill-size": self.prefill_chunk,
            "--cuda-graph-max-bs-prefill": self.prefill_graph,
            f"{self.decode_requests_flag} x --speculative-num-draft-tokens":
                self.decode_requests * self.tokens_per_request,
        }
        return {flag: tokens_per_ep_rank([n], self.attn_tp_size) for flag, n in kinds.items()}


def budget_from_server_args(cfg: Any) -> TokenBudget:
    """The budget of a resolved SGLang configuration (``resolving_view(server_args)``)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    attn_dp = int(cfg.attn_dp_size or 1)
    graphs = cfg.cuda_graph_config

    def graph_max_bs(phase: Any) -> int:
        return 0 if phase.backend == Backend.DISABLED else int(phase.max_bs or 0)

    decode_graph = 0 if graphs is None else graph_max_bs(graphs.decode)
    prefill_graph = 0 if graphs is None else graph_max_bs(graphs.prefill)
    requests, flag = decode_graph, "--cuda-graph-max-bs-decode"
    if cfg.max_running_requests is not None and cfg.max_running_requests // attn_dp > requests:
        requests, flag = cfg.max_running_requests // attn_dp, f"--max-running-requests / --attn-dp-size {attn_dp}"
    if cfg.disaggregation_mode == "prefill":  # a prefill server runs no decode steps
        requests = 0
    per_request = 1
    if cfg.speculative_algorithm:
        per_request = max(int(cfg.speculative_num_draft_tokens or 1), int(cfg.speculative_eagle_topk or 1))
    prefill = 0 if cfg.disaggregation_mode == "decode" else int(cfg.chunked_prefill_size or 0)
    return TokenBudget(prefill_chunk=max(prefill, 0), prefill_graph=prefill_graph, decode_requests=requests,
                       tokens_per_request=per_request, attn_tp_size=max(int(cfg.tp_size) // attn_dp, 1),
                       decode_requests_flag=flag)


def check_token_budget(budget: TokenBudget, capacity: int) -> None:
    """Raise MegaMoEConfigError when some forward brings more than ``capacity`` tokens to an EP rank."""
    per_rank = budget.per_rank()
    flag, need = max(per_rank.items(), key=lambda item: item[1])
    if need <= capacity:
        return
    split = f" over {budget.attn_tp_size} attention-TP ranks" if budget.attn_tp_size > 1 else ""
    raise MegaMoEConfigError(
        f"--moe-a2a-backend {BACKEND_NAME}: one forward can bring {need} tokens to an EP rank ({flag}{split}), "
        f"more than MEGA_MAX_TOKENS_PER_RANK={capacity}. Raise MEGA_MAX_TOKENS_PER_RANK to at least {need} or lower "
        f"{flag} (per-rank tokens of each forward: {per_rank})."
    )


def require_chunked_prefill(cfg: Any) -> None:
    """A prefill without chunking is bounded only by the prompt length: refuse it (SGLang's in-tree
    megamoe refuses the same, for the same fixed-capacity reason)."""
    if cfg.disaggregation_mode != "decode" and not (cfg.chunked_prefill_size and cfg.chunked_prefill_size > 0):
        raise MegaMoEConfigError(
            f"--moe-a2a-backend {BACKEND_NAME} needs chunked prefill (--chunked-prefill-size > 0, got "
            f"{cfg.chunked_prefill_size}): without it one prefill forward is bounded only by the prompt length, "
            "not by MEGA_MAX_TOKENS_PER_RANK"
        )


def validate_megamoe_ep_token_budget(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Overrides the resolution step ``validate_mega_moe_token_budget_for_model`` (SGLang's own
    MegaMoE budget check, run after speculative decoding is resolved): SGLang's step, then ours."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from megamoe_backend.knobs import Knobs

    previous(server_args)
    cfg = resolving_view(server_args)
    if cfg.moe_a2a_backend != BACKEND_NAME:
        return
    require_chunked_prefill(cfg)
    check_token_budget(budget_from_server_args(cfg), Knobs.from_env().max_tokens_per_rank)
