"""The torch-emulated quantised layer: the GPU layer's exact-math twin, and the bound its rows keep.

Why a twin besides the fp32 gates: the gates (relL2 vs fp32 on dequantised weights: 0.10 A8W4, 0.28
A4W4) are the accuracy claim, and they are loose enough that wrong math passes them (issue 46: the
CPU layer's output x1.10 passes the A4W4 gate, x1.05 the A8W4 one). The twin runs the same plan
(dispatch wire, A quantised per 1x32 MX block, SwiGLU, A2 re-quantised per 1x32 block, combine wire,
top-k summed in fp32) with TorchReferenceExperts (fp64 products rounded to fp32 per row) over the
torch forward, so the Triton layer differs from it only by accumulation order and what that moves.

ROW_TOL, the bound: each output row within 2e-2 relative (L2) of the twin's. Fitted to the
accumulation: fp32 sums in K-chunk order (the bf16 MMA, and the interpreter's fp32 dot) differ from
fp64 by ~1e-6, which reaches the output only where it moves an A2 element across an fp8 / fp4 rounding
edge, and the FP8 tensor core of the frag8 decoder accumulates with a shorter mantissa: on the H200
the experts differ from the exact reference by relL2 9.3e-3 (A8W4) / 3.2e-3 (A4W4) at DSV4-Pro shapes
(tests/kernels/test_gpu_experts.py FRAG8_TOL 2e-2; docs/triton.md), and a token's row sums k such pair
rows with independent errors, so its relative error stays near the pairs' (~1e-2), under 2e-2. Wrong
math misses it: x1.05 is 5e-2 on every row, a pair dropped from a row of k = 6 ~4e-1 on that row.

The fp8 combine wire (fp8_blockwise_1x32) rounds every pair row to e4m3 (3 mantissa bits) before
the sum, so an accumulation-order difference that moves an element across an e4m3 rounding edge
changes it by up to 2^-4 relative: a few rows go further. Measured on the H200 (2026-12-04, tree of
this change, test_gpu_layer.py a8w4 / fp8 / fp8_blockwise_1x32): worst row 3.0e-2, over the 2e-2
bound. For that wire the bound is 6e-2 on the worst row (COMBINE_FP8_ROW_TOL) plus 2e-2 on the MEAN
row error (MEAN_TOL), which x1.05 (5e-2 on every row) still fails; this pair of bounds is fitted to
that one measured failure and has not run on the GPU since.
"""

from __future__ import annotations

import torch

from megamoe_backend.experts import TorchReferenceExperts
from megamoe_backend.layer import MegaMoELayer
from megamoe_backend.transport import LocalTransport

ROW_TOL = 2e-2
COMBINE_FP8_ROW_TOL = 6e-2  # worst row with the fp8 combine wire (module docstring)
MEAN_TOL = 2e-2  # mean row error with the fp8 combine wire: every row x1.05 is 5e-2


def tolerances(combine: str) -> tuple[float, float]:
    """(worst row, mean row) bound for this combine wire."""
    return (COMBINE_FP8_ROW_TOL, MEAN_TOL) if combine == "fp8_blockwise_1x32" else (ROW_TOL, ROW_TOL)


def torch_emulated_layer(layer: MegaMoELayer, weights, device) -> MegaMoELayer:
    """``layer``'s plan over the torch forward with the reference experts on ``weights`` (row-major
    MXFP4 or bf16, as given to ``layer``): the same wires and quantisation, exact products."""
    return MegaMoELayer(layer.plan, weights, device=device, provider=TorchReferenceExperts(), transport=LocalTransport())


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row ||got - want|| / ||want|| (fp32); a row the twin leaves zero (every route masked) must be zero."""
    g, w = got.float(), want.float()
    diff, norm = (g - w).norm(dim=1), w.norm(dim=1)
    return torch.where(norm > 0, diff / norm.clamp_min(1e-30), torch.where(diff > 0, float("inf"), 0.0))


def assert_rows_near(got: torch.Tensor, want: torch.Tensor, what: str, combine: str = "bf16") -> float:
    """Every row within the combine wire's worst-row bound of the twin, and the rows' mean within its
    mean bound (``tolerances``); returns the worst row's error (tests print it)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    tol, mean_tol = tolerances(combine)
    err = row_errors(got, want)
    worst, row, mean = float(err.max()), int(err.argmax()), float(err.mean())
    assert worst <= tol, f"{what}: row {row} is {worst:.3e} from the torch-emulated quantised layer (bound {tol})"
    assert mean <= mean_tol, f"{what}: the mean row is {mean:.3e} from the torch-emulated layer (bound {mean_tol})"
    return worst
