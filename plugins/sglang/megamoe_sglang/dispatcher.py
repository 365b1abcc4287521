"""MegaMoEDispatcher: SGLang's dispatcher slot for ``--moe-a2a-backend megamoe_ep``.

SGLang's ``FusedMoE.forward`` runs ``dispatcher.dispatch -> quant_method.apply (the runner) ->
dispatcher.combine``. MegaMoE's layer owns the whole quantise-once -> dispatch -> experts ->
combine pipeline (one code path for vLLM, SGLang and the CLI), so — like SGLang's own
``flashinfer_megamoe`` — the dispatcher is a passthrough on SGLang's side and the runner core
(:mod:`.runner`) runs the pipeline, all-to-all included.

What the passthrough does differently from SGLang's ``StandardDispatcher``: it keeps the router's
*global* (physical) expert ids instead of mapping them to this rank's local slots and masking the
rest — MegaMoE's dispatch needs the global ids to know where each token goes.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher, CombineInput
from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput


class MegaMoEDispatcher(BaseDispatcher):
    def __init__(self, moe_runner_config) -> None:
        super().__init__()
        self.moe_runner_config = moe_runner_config
        self.runner_backend = moe_runner_config.runner_backend
        # FusedMoE reads these optional attributes of StandardDispatcher; we map nothing locally.
        self.local_expert_mapping = None
        self.expert_mask_gpu = None

    def dispatch(self, hidden_states: torch.Tensor, topk_output) -> StandardDispatchOutput:
        if not (hasattr(topk_output, "topk_ids") and hasattr(topk_output, "topk_weights")):
            raise TypeError(
                f"--moe-a2a-backend megamoe_ep needs router ids and weights; got a "
                f"{type(topk_output).__name__} (a fused-router top-k format)"
            )
        return StandardDispatchOutput(hidden_states=hidden_states, hidden_states_scale=None, topk_output=topk_output)

    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        # The runner's combine already summed every token's expert outputs on its source rank.
        return combine_input.hidden_states
