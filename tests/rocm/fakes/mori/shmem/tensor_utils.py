"""Fake mori.shmem.tensor_utils.mori_shmem_create_tensor (python/mori/shmem/tensor_utils.py:46-56).

Same failure as the real one when the heap is full: ``assert ptr != 0, "mori_shmem.shmem_malloc
failed"`` (line 50). The tensor itself is an ordinary CPU tensor; ``count_only=True`` (fake-only)
takes the bytes from the heap without allocating them, for GPU-sized buffers the fakes never touch.
"""

import torch

from . import api


def mori_shmem_create_tensor(shape, dtype, count_only: bool = False) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    ptr = api.shmem_malloc(nbytes)
    assert ptr != 0, "mori_shmem.shmem_malloc failed"
    if count_only:
        return torch.empty(0, dtype=dtype)
    if dtype.itemsize == 1 and dtype not in (torch.uint8, torch.int8):
        return torch.zeros(shape, dtype=torch.uint8).view(dtype)
    return torch.zeros(shape, dtype=dtype)
