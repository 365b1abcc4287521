"""aiter's fused MegaMoE runtime (ROCm): it owns dispatch, both GEMMs and combine (docs/rocm.md)."""

from __future__ import annotations

import torch

from ...transport import PeerInputError
from .base import LayerForward, refuse_capture


class FusedForward(LayerForward):
    name = "fused"

    def __init__(self, layer, group, layer_id: int) -> None:
        from ...experts.aiter import AiterFusedMoE

        super().__init__(layer.plan, layer.device, layer.name)
        self.fused = AiterFusedMoE(layer.plan, group, layer.device, selection=layer.plan.backends, layer_id=layer_id)
        self.fused_weights = self.fused.prepare_weights(layer.weights)

    def __call__(self, x, topk_ids, topk_weights, output_scale, out, max_tokens_across_ranks):
        from .torch_path import host_input_status

        if out is not None or max_tokens_across_ranks is not None:
            raise ValueError("[megamoe] out= / max_tokens_across_ranks= are supported by the device forward only")
        refuse_capture(self)
        status, message = host_input_status(self, x, topk_ids, topk_weights)
        if status:
            # take part in the collective as an idle rank (one zero-weight token), so the peers waiting in
            # aiter's kernel finish their step, then refuse this rank's input by name
            plan = self.plan
            self.fused(torch.zeros(0, plan.hidden, dtype=torch.bfloat16, device=self.device),
                       torch.zeros(0, plan.topk, dtype=torch.int64, device=self.device),
                       torch.zeros(0, plan.topk, dtype=torch.float32, device=self.device), self.fused_weights)
            raise PeerInputError(f"[megamoe] {message}; this rank took part as an idle rank, no peer waits on it")
        y = self.fused(x, topk_ids, topk_weights, self.fused_weights)
        return y if output_scale == 1.0 else (y.float() * output_scale).to(torch.bfloat16)
