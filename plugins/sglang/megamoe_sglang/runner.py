"""MegaMoERunnerCore: the ``megamoe_ep`` entry of SGLang's MoE runner registry.

Registered with ``register_moe_runner_core("megamoe_ep", MegaMoERunnerCore)``, so SGLang's own
``MoeRunner(RegisteredMoeRunnerBackend("megamoe_ep"), config)`` builds it. It is a
``DispatchMoeRunnerCore``: SGLang hands it the dispatch output directly (no pre/post permute), and
it returns SGLang's ``StandardCombineInput``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.layers.moe.moe_runner.base import DispatchMoeRunnerCore, MoeQuantInfo, MoeRunnerConfig
from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
from sglang.srt.layers.moe.utils import resolve_moe_runner_backend

from megamoe_backend.layer import MegaMoELayer
from megamoe_backend.plan import token_bound

from .dp_bound import max_tokens_across_ranks
from .selection import BACKEND_NAME


@dataclass
class MegaMoEQuantInfo(MoeQuantInfo):
    """What the runner needs per layer: that layer's MegaMoE runtime (plan, weights, transport)."""

    runtime: MegaMoELayer


class MegaMoERunnerCore(DispatchMoeRunnerCore):
    def __init__(self, config: MoeRunnerConfig) -> None:
        super().__init__(config)

    @property
    def runner_backend(self):
        return resolve_moe_runner_backend(BACKEND_NAME)

    def run_from_dispatch(
        self, dispatch_output: Any, quant_info: MegaMoEQuantInfo, runner_config: MoeRunnerConfig, hooks: Any = None
    ) -> StandardCombineInput:
        if hooks is not None:
            raise NotImplementedError("--moe-a2a-backend megamoe_ep does not support LoRA on MoE layers")
        x = dispatch_output.hidden_states
        topk = dispatch_output.topk_output
        # Same contract as SGLang's Triton runner: it scales the summed output itself, in fp32 before
        # the one rounding (MegaMoE's top-k sum applies output_scale there: no extra launch, no second rounding)
        scale = runner_config.routed_scaling_factor
        runtime = quant_info.runtime
        out = runtime.forward(x, topk.topk_ids, topk.topk_weights, output_scale=1.0 if scale is None else float(scale),
                              **token_bound.bound_kwargs(runtime, lambda: max_tokens_across_ranks(runtime.plan.mtpr)))
        return StandardCombineInput(hidden_states=out.to(x.dtype))

