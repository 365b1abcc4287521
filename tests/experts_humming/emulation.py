"""humming-kernels' indexed GEMM as its adapter promises it (megamoe_backend/experts/humming/library.py),
in torch: what the provider's CPU tests run in its place, and what the GPU test holds the real one to.

The contract, in its own words: for each of the ``padded_rows[0]`` sorted rows r (tiles of BM rows, tile t
with the weights of ``expert_ids[t]``), id = sorted_ids[r] read as uint32; when id < M * top_k (M = A's
rows), C[id] = bf16(a_scale[id // top_k] * sum_k A[id // top_k, k] * W_e[n, k]); other rows of C are
not written (block-FP8: a_scale holds one scale per 1 x 128 group of A's row, each scaling its group's
products; the weights are e4m3 times their 128 x 128 block scale). The weights are the MXFP4 values exactly (humming folds them exactly within 11 binades of a
row's largest block scale: weights.HUMMING_WINDOW), so the emulation takes the dequantised row-major
weights. ``walked`` counts the sorted rows each call walked (the work the provider asks for).
"""

from __future__ import annotations

import torch

from megamoe_backend.formats import MXTensor, dequantize_mx
from megamoe_backend.formats.block_fp8 import dequantize_weight_blocks


class EmulatedSublayer:
    def __init__(self, name: str, weights: torch.Tensor, block_m: int) -> None:
        self.name, self.weights, self.bm = name, weights.double(), block_m  # weights fp64 [E, N, K]
        self.walked: list[int] = []

    def block_m(self, valid_m: int) -> int:
        return self.bm

    def gemm(self, a, a_scale, weight, scale, scale2, out, sorted_ids, expert_ids, padded_rows, locks, top_k: int,
             valid_m: int) -> None:
        rows = int(padded_rows[0])
        self.walked.append(rows)
        m = a.shape[0]
        ids = sorted_ids[:rows].to(torch.int64) & 0xFFFFFFFF  # uint32, as the kernel reads them
        scale = a_scale.double().view(m, -1)
        x = a.float().double() * scale.repeat_interleave(a.shape[1] // scale.shape[1], dim=1)
        for t in range(rows // self.bm):
            sel = ids[t * self.bm:(t + 1) * self.bm]
            sel = sel[sel < m * top_k]
            if sel.numel():
                w = self.weights[int(expert_ids[t])]
                out[sel] = (x[sel // top_k] @ w.T).float().to(out.dtype)


class EmulatedLibrary:
    """library.py's surface (transform, jit, locks, version) over EmulatedSublayer: the weights keep their
    row-major bytes (the emulation reads them dequantised) in ExpertWeights' humming storage."""

    def __init__(self, block_m: int = 16) -> None:
        self.bm = block_m
        self.sublayers: dict[str, EmulatedSublayer] = {}

    def transform(self, name: str, packed: torch.Tensor, scales: torch.Tensor):
        w = dequantize_mx(MXTensor(packed, scales, "fp4"))
        sub = EmulatedSublayer(name, w, self.bm)
        self.sublayers[name] = sub
        e, n = packed.shape[:2]
        return sub, packed.clone(), scales.clone(), torch.ones(e, n, dtype=torch.bfloat16, device=packed.device)

    def transform_block_fp8(self, name: str, weight: torch.Tensor, scales: torch.Tensor):
        sub = EmulatedSublayer(name, dequantize_weight_blocks(weight, scales, name), self.bm)
        self.sublayers[name] = sub
        return sub, weight.clone(), scales.clone(), None

    def jit(self, sublayers, device) -> tuple[int, float]:
        return 0, 0.0

    def locks(self, device) -> torch.Tensor:
        return torch.zeros(8, dtype=torch.int32, device=device)

    def version(self) -> str:
        return "emulated"
