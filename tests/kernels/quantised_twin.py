"""The torch-emulated quantised layer: the GPU layer's exact-math twin, and the bounds its rows keep.

Why a twin besides the fp32 gates: the gates (relL2 vs fp32 on dequantised weights: 0.10 A8W4, 0.28
A4W4) are the accuracy claim, and they are loose enough that wrong math passes them (issue 46: the
CPU layer's output x1.10 passes the A4W4 gate, x1.05 the A8W4 one). The twin runs the same plan
(dispatch wire, A quantised per 1x32 MX block, SwiGLU, A2 re-quantised per 1x32 block, combine wire,
top-k summed in fp32) with TorchReferenceExperts (fp64 products rounded to fp32 per row) over the
torch forward, so the Triton layer differs from it only by accumulation order and what that moves.

Where the bounds come from: one number the experts' own tests hold, FRAG8_TOL (expert_problems.py,
2e-2): a pair row of the frag8 GEMMs (the FP8 tensor core adds products with fewer bits than fp32)
may differ from the exact one by that much (H200: 9.6e-3 A8W4, 3.2e-3 A4W4 at DSV4-Pro shapes). What
that difference becomes at the layer's output depends on the combine wire:
- bf16 combine (ROW_TOL 2e-2, every row and the mean): a token's row sums k pair rows with independent
  differences, so its relative difference stays near the pairs' (the model below: 2.0e-2 per row at
  pair rows 2e-2 off). x1.05 is 5e-2 on every row, a pair dropped from a row of k = 6 ~4e-1 on it.
- fp8 combine (fp8_blockwise_1x32: e4m3 + one E8M0 per 32, per pair row, before the fp32 sum): the
  wire rounds both sides, and a difference that moves an element across an e4m3 rounding edge comes out
  as a whole e4m3 step (2^-4 to 2^-3 relative), so the output rows differ by more than the pair rows
  do. COMBINE_FP8_MEAN_TOL 4e-2 on the mean row: the model (test_quantised_twin_bound.py: the twin's
  pair rows perturbed by additive noise of relative size d before the wire, against the unperturbed
  twin) gives a mean row of 2.3e-2 at d = 9.3e-3 (measured on the H100, 2026-12-06: 2.24e-2, the GPU
  layer against this twin, tree 228d517) and 3.5e-2 at d = FRAG8_TOL; x1.05 gives 6.8e-2 (it is
  rounded too), so 4e-2 lies between. COMBINE_FP8_ROW_TOL 6e-2 on the worst row: measured rows are
  heavier-tailed than the model's even noise (bf16 combine, H100: worst row 1.72e-2 where the model's
  rows sit at 1.0e-2), so 1.7x the model's 3.5e-2. History: the first bound (2e-2 worst) failed on the
  H200 at 3.0e-2 (2026-12-04); its refit (2e-2 mean, fitted to that one failure) failed on the H100 at
  2.24e-2: hence the model.
"""

from __future__ import annotations

import torch

from megamoe_backend.experts import TorchReferenceExperts
from megamoe_backend.layer import MegaMoELayer
from megamoe_backend.transport import LocalTransport

ROW_TOL = 2e-2  # bf16 combine: every row (module docstring)
COMBINE_FP8_ROW_TOL = 6e-2  # fp8 combine: the worst row
COMBINE_FP8_MEAN_TOL = 4e-2  # fp8 combine: the mean row (model at FRAG8_TOL 3.5e-2 < this < x1.05's 6.8e-2)


def tolerances(combine: str) -> tuple[float, float]:
    """(worst row, mean row) bound for this combine wire."""
    return (COMBINE_FP8_ROW_TOL, COMBINE_FP8_MEAN_TOL) if combine == "fp8_blockwise_1x32" else (ROW_TOL, ROW_TOL)


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
