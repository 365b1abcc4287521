"""What every forward path shares: the shape checks and the caller's ``out`` buffer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ...plan import LayerPlan
from ...transport import PeerInputError


class LayerForward(ABC):
    """A way to run one layer's routed experts (forwards/__init__.py). ``name``: what moves the rows,
    as the startup line says it; ``workspace``: the device buffers where the path has them."""

    name = "abstract"
    workspace = None

    def __init__(self, plan: LayerPlan, device: torch.device, layer_name: str) -> None:
        self.plan, self.device, self.layer_name = plan, device, layer_name

    @abstractmethod
    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, output_scale: float,
                 out: torch.Tensor | None, max_tokens_across_ranks: int | None) -> torch.Tensor:
        """MegaMoELayer.forward's contract, on this path."""

    def raise_if_bad_input(self) -> None:
        """Raise what the device checks recorded (paths with a status word); else nothing to do."""

    def shape_status(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[int, str]:
        """(status, message) from shapes alone (no device data is read); status != 0: bad input."""
        plan = self.plan
        if x.dim() != 2 or x.shape[1] != plan.hidden:
            return 3, f"hidden_states must be [tokens, {plan.hidden}], got {tuple(x.shape)}"
        t = x.shape[0]
        if tuple(topk_ids.shape) != (t, plan.topk) or tuple(topk_weights.shape) != (t, plan.topk):
            return 3, (
                f"topk_ids / topk_weights must be [{t}, {plan.topk}], got {tuple(topk_ids.shape)} / "
                f"{tuple(topk_weights.shape)}"
            )
        if t > plan.mtpr:
            return 1, (
                f"{t} tokens on ep_rank {plan.ep_rank} exceed MEGA_MAX_TOKENS_PER_RANK={plan.mtpr}; "
                "raise the knob (or the engine's max batched tokens must stay below it); no token was dropped"
            )
        return 0, ""

    def check_shapes(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """The device forwards' input check: shapes, dtypes and devices only, raised here."""
        status, message = self.shape_status(x, topk_ids, topk_weights)
        if status == 1:
            raise PeerInputError(f"[megamoe] {message}")
        if status:
            raise ValueError(f"[megamoe] {message}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"[megamoe] topk_ids must be int32 or int64, got {topk_ids.dtype}")
        for tensor_name, tensor in (("hidden_states", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if tensor.device != self.device:
                raise ValueError(f"[megamoe] {tensor_name} is on {tensor.device}, the layer on {self.device}")

    def output(self, t: int, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return torch.empty(t, self.plan.hidden, dtype=torch.bfloat16, device=self.device)
        hidden = self.plan.hidden
        if out.shape != (t, hidden) or out.dtype != torch.bfloat16 or out.stride(1) != 1 or out.device != self.device:
            raise ValueError(f"[megamoe] out must be bf16 [{t}, {hidden}] on {self.device}, got {tuple(out.shape)} {out.dtype}")
        return out


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def refuse_capture(path: LayerForward) -> None:
    """The eager paths (torch, fused) read row counts on the host: a clear error instead of a crash
    inside the engine's CUDA-graph capture."""
    if capturing(path.device):
        raise RuntimeError(
            f"[megamoe] {path.layer_name}: this forward (ep_size {path.plan.ep_size}, transport {path.name}) reads row "
            "counts on the host and cannot be captured in a CUDA graph; only the device forward (CUDA, triton experts, "
            "ep_size 1 or MEGA_DISPATCH=symm | ipc) can. Use one of those, or run the engine eagerly (vLLM "
            "--enforce-eager, SGLang --disable-cuda-graph)."
        )
