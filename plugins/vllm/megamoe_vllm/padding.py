"""Padded rows of vLLM's batch never reach an expert: their route ids become -1 on the device.

Why: under CUDA graphs vLLM pads a batch to the next captured size (and, with DP, to the largest
rank's size). The router still picks experts for the padded rows, so without a mask they are
dispatched, computed and (at EP > 1) sent to other ranks like real tokens: wasted expert work in
proportion to the padding, and rows of garbage activations on the wire (the failure of vLLM issue
#56389). vLLM 0.34 marks them: ``ForwardContext.is_padding`` is a device bool mask over the token
axis (``v1/worker/gpu/model_runner.py`` fills it per step; capture marks every dummy row), so the
mask is applied on the device and replays with the graph: no host read, nothing sized by the data.

vLLM 0.32 / 0.33 have no such mask (``is_padding`` absent): the rows run as before there.
The masked ids go into a buffer allocated once per layer runtime (``PaddedIds``), never per call.
"""

from __future__ import annotations

from typing import Any

import torch


def padding_rows(num_tokens: int) -> torch.Tensor | None:
    """vLLM's padding mask for this forward's first ``num_tokens`` rows, or None when vLLM set none
    (older vLLM, no forward context, or a mask shorter than the batch)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    mask = getattr(get_forward_context(), "is_padding", None)
    if mask is None or mask.dim() != 1 or mask.shape[0] < num_tokens:
        return None
    return mask[:num_tokens]


class PaddedIds:
    """Route ids with padded rows set to -1 (the layer's "no expert"), written into buffers sized
    once (``max_tokens`` x ``topk`` for each id dtype vLLM may pass)."""

    def __init__(self, max_tokens: int, topk: int, device: Any) -> None:
        self.buffers = {dtype: torch.empty(max_tokens, topk, dtype=dtype, device=device)
                        for dtype in (torch.int32, torch.int64)}

    def apply(self, topk_ids: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        """``topk_ids`` with every row ``padding`` marks set to -1 (``topk_ids`` itself when no mask)."""
        if padding is None:
            return topk_ids
        t = topk_ids.shape[0]
        buf = self.buffers.get(topk_ids.dtype)
        if buf is None or t > buf.shape[0] or topk_ids.shape[1] != buf.shape[1]:
            raise ValueError(f"[megamoe] topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype} does not fit the padded-id "
                             f"buffers ({tuple(next(iter(self.buffers.values())).shape)}, int32 / int64)")
        out = buf[:t]
        out.copy_(topk_ids)
        out.masked_fill_(padding[:, None], -1)  # two in-place kernels on fixed memory: capturable, no host read
        return out
