"""Programmatic dependent launch (PDL) between the experts forward's launches (issue 48 item 3).

Why: at decode a forward is a chain of small launches (layout, row re-scales) around two
weight-streaming GEMMs, and each boundary costs a launch and a ramp: the next kernel's programs are
scheduled only once the last program of the previous one has ended and its writes are flushed.
Launched with PDL (Hopper and later), a kernel's programs may be scheduled while its predecessor
still runs; they wait in ``griddepcontrol.wait`` until the predecessor has finished and its memory
is visible, so the launch and the scheduling overlap the predecessor's tail. The kernels: the layout's
three (layout_kernels.py), frag8's row re-scales and the split / frag A conversion (gather.py), GEMM1 and
GEMM2. Measured on an H100 (emulated EP 8 step, 48 local experts, A8W4, span per rank, two interleaved
rounds, benchmarks/results/h100_pdl_rescale_ab.json): 8 tokens 407.6 -> 404.2 us with the bound, 447.5 ->
435.6 without; 128 tokens 676.0 -> 671.8 / 705.5 -> 690.1; launch gaps 6-15 -> 4 us; 8192 tokens within
0.3 % (8748 -> 8733 us in one call).

The rule every PDL kernel here keeps, so the chain stays ordered as plain stream order would order
it: the wait is the FIRST thing each program does (before any load, store, atomic or early return),
then it lets its own dependents launch. A program that ended without waiting could let its kernel
count as finished before its predecessor is, and a later kernel reading the predecessor's output
(GEMM2 reads the layout two launches back) would race. Kernels not launched with PDL (torch ops,
the barrier, the dispatch) wait for the whole previous kernel as usual, and each PDL kernel has
itself waited for its predecessor, so everything before it is finished too.

CUDA-graph capture keeps the programmatic edges (measured on an H200 with Triton 3.6: eager and
graph results equal; this project's GPU tests, graph against eager, on an H100 on 2026-12-06). The Triton
interpreter and non-NVIDIA GPUs run without it (``pdl_launch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .config import interpreting

PDL_MIN_CAPABILITY = (9, 0)  # griddepcontrol: sm_90 and later


def pdl_launch(device: torch.device) -> bool:
    """Whether the experts forward's kernels on ``device`` are launched with PDL (``launch_pdl``) and
    compiled with their wait (``PDL``): an NVIDIA GPU of compute capability 9.0 or later, not the
    interpreter. The one place this is decided; ForwardLaunch.pdl carries it to every launch."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting() or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= PDL_MIN_CAPABILITY


def pdl_args(pdl: bool) -> dict:
    """The launch keywords of a PDL-aware kernel: its PDL constexpr, and Triton's launch_pdl option only
    when on (Triton's AMD backend has no such option and refuses a launch that names it)."""
    return dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a PDL-aware kernel: wait for the predecessor (its writes visible), then let
    the successor's programs be scheduled (they wait in turn). Nothing without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
