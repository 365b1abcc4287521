"""The data checks of the forwards whose routing is done in torch ops (aiter's fused runtime,
the mori device forward): the first bad id is recorded in the status word, on the device.

Why not on the host: ``bool((ids < -1).any())`` stalls the stream once per layer and cannot be
captured in a CUDA graph. The route kernel (route.py) does the same for the CUDA device forwards
inside its launch; here the mapping to rank-major ids runs in torch ops (experts/aiter/routing.py),
so the check is a few fixed-shape torch ops next to it: sticky like the kernels' (a word that
already holds a problem keeps it), read by the host at the next eager check or by the watchdog.
"""

from __future__ import annotations

import torch

from .status import BAD_EXPERT_ID, NONFINITE_ROW


def record_bad_ids(topk_ids: torch.Tensor, num_physical: int, status_word: torch.Tensor, layer_id: int) -> None:
    """Record the first id outside [-1, num_physical) as (BAD_EXPERT_ID, layer_id, value, token) in
    ``status_word`` (int64 [4]) unless it already holds a problem. Device ops, no host read."""
    t, k = topk_ids.shape
    if t == 0:
        return
    ids = topk_ids.reshape(-1).to(torch.int64)
    bad = (ids < -1) | (ids >= num_physical)
    first = torch.argmax(bad.to(torch.uint8))  # the first bad entry (argmax returns the first maximum)
    value = ids.gather(0, first.view(1)).view(())  # (``ids[first]`` with a 0-d index reads it on the host)
    entry = torch.stack((torch.full_like(first, BAD_EXPERT_ID), torch.full_like(first, layer_id), value, first // k))
    take = bad.any() & (status_word[0] == 0)
    status_word.copy_(torch.where(take, entry, status_word))


def record_nonfinite_rows(out: torch.Tensor, status_word: torch.Tensor, layer_id: int) -> None:
    """Record the first output row holding NaN / Inf as (NONFINITE_ROW, layer_id, 0, row), as the
    top-k sum kernel does on the CUDA device forwards. Device ops, no host read."""
    if out.shape[0] == 0:
        return
    bad = ~torch.isfinite(out).all(dim=1)
    first = torch.argmax(bad.to(torch.uint8))
    entry = torch.stack((torch.full_like(first, NONFINITE_ROW), torch.full_like(first, layer_id), torch.zeros_like(first),
                         first))
    take = bad.any() & (status_word[0] == 0)
    status_word.copy_(torch.where(take, entry, status_word))
