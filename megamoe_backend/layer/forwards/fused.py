"""aiter's fused MegaMoE runtime (ROCm): it owns dispatch, both GEMMs and combine (docs/rocm.md).

No host synchronisation: the ids are remapped and checked on the device (bad ids go to the status
word, as on the CUDA device forwards), the runtime for the step is chosen from the engine's token
bound (a Python int, the same on every rank), and aiter's kernels read their counts on the device.
So the step can be captured in a graph, as vLLM 0.34 captures its aiter_mega_moe. The runtimes are
built when the layer is, before the engine warms up or captures. Shape problems are known on the
host: that rank still takes part (as an idle rank) so no peer waits in aiter's kernel, then raises;
what the status word recorded is raised after the step's collective, never before it.
"""

from __future__ import annotations

import torch

from ...plan.token_bound import bound_problem
from ...transport import PeerInputError
from .base import capturing
from .device import WorkspaceForward


class FusedForward(WorkspaceForward):
    name = "fused"

    def __init__(self, layer, group, layer_id: int) -> None:
        from ...experts.aiter import AiterFusedMoE
        from ..device.rocm_workspace import FusedWorkspace

        plan = layer.plan
        super().__init__(layer, group, lambda: FusedWorkspace(plan, layer.device))
        self.fused = AiterFusedMoE(plan, group, layer.device, selection=plan.backends, layer_id=layer_id)
        self.fused_weights = self.fused.prepare_weights(layer.weights)
        self.fused.build(self.fused_weights)  # every shared runtime exists before the engine's warm-up / capture

    def _idle_step(self, message: str, bound: int | None) -> None:
        """Take part in the collective with no tokens, so peers in aiter's kernel finish, then raise."""
        plan = self.plan
        self.fused(torch.zeros(0, plan.hidden, dtype=torch.bfloat16, device=self.device),
                   torch.zeros(0, plan.topk, dtype=torch.int64, device=self.device),
                   torch.zeros(0, plan.topk, dtype=torch.float32, device=self.device), self.fused_weights,
                   bound=None if bound_problem(0, bound, self.fused.capacity) else bound)
        raise PeerInputError(f"[megamoe] {message}; this rank took part as an idle rank, no peer waits on it")

    def __call__(self, x, topk_ids, topk_weights, output_scale, out, max_tokens_across_ranks):
        from ..device.id_check import record_bad_ids

        plan, ws = self.plan, self.workspace
        status, message = self.shape_status(x, topk_ids, topk_weights)
        if not status:
            message = bound_problem(x.shape[0], max_tokens_across_ranks, self.fused.capacity)
        if status or message:
            self._idle_step(f"{self.layer_name}: {message}", max_tokens_across_ranks)
        record_bad_ids(topk_ids, plan.placement.num_physical, ws.status.word, self.status_index)
        dest = None if out is None else self.output(x.shape[0], out)  # checks the caller's buffer
        y = self.fused(x, topk_ids, topk_weights, self.fused_weights, out=dest if output_scale == 1.0 else None,
                       bound=max_tokens_across_ranks)
        if output_scale != 1.0:
            scaled = (y.float() * output_scale).to(torch.bfloat16)
            y = scaled if dest is None else dest.copy_(scaled)
        ws.status.publish()
        if not capturing(self.device):  # after the collective: raising before it would leave the peers waiting
            self.raise_if_bad_input()
        return y
