"""How the benches time a forward: CUDA-graph replays back to back, single replays after an idle gap,
and the ceilings (a copy, a bf16 GEMM, an FP8 GEMM) measured at the start of a run.

Why one module: ``megamoe bench experts``, ``bench layer`` (ep_size 1, ``--ep N``, ``--emulate``) and the
peers they measure beside the project (benchmarks/peers.py) must time every figure the same way, in the same
run; the benches import this, nothing here imports a bench.
"""

from __future__ import annotations

import sys
import time

import torch

from megamoe_backend.experts.triton.config import interpreting

from .gpu_clock import ClockSampler

CEILING_GEMM_N = 8192  # the ceilings' GEMMs: N x N x N, bf16 and e4m3


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """One call of fn captured as a CUDA graph, after a warm-up call on a side stream (so lazy
    allocations and autotuning happen outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_or_eager(fn) -> tuple:
    """(call, graphed): fn's CUDA-graph replay (capturing also proves the forward is capturable), or fn
    itself where capture fails (reported; the case records graphed=False) or there is no GPU."""
    if not torch.cuda.is_available() or interpreting():
        return fn, False
    try:
        return capture_graph(fn).replay, True
    except Exception as exc:  # noqa: BLE001 - fall back to eager timing, recorded in the case
        print(f"  graph capture failed ({type(exc).__name__}: {exc}); timing eagerly", file=sys.stderr)
        torch.cuda.synchronize()
        return fn, False


def time_fn(fn, use_graph: bool) -> tuple[float, bool]:
    """Median µs per call; CUDA-graph replays when possible (graph_or_eager)."""
    if not torch.cuda.is_available() or interpreting():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6, False
    fn()
    torch.cuda.synchronize()
    call, graphed = graph_or_eager(fn) if use_graph else (fn, False)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end), 1e-3)
    reps = int(min(200, max(3, 60.0 / one)))
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            call()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    samples.sort()
    return samples[len(samples) // 2], graphed


def time_isolated(replay, n: int = 10, idle_s: float = 0.0) -> list[float]:
    """µs of each of n single calls, each after ``idle_s`` of host sleep (the GPU idles) and queued
    behind a ~3 ms GPU sleep (so the timing holds no launch latency): the whole forward near full
    clock, with the gaps between its kernels, and a tight figure for A/B of launch structure, which
    sums of kernel times cannot see. Not the bench's headline figure: a serving GPU runs forwards back
    to back, power-capped on the H200 here (docs/triton.md, "Sustained runs are power-capped")."""
    out = []
    for _ in range(n):
        if idle_s:
            time.sleep(idle_s)
        torch.cuda._sleep(6_000_000)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        replay()
        e1.record()
        torch.cuda.synchronize()
        out.append(round(e0.elapsed_time(e1) * 1e3, 1))
    return out


def measure_ceilings(device: torch.device) -> dict:
    """What this GPU reaches, timed like a case (back to back): a bf16 GEMM, an FP8 GEMM and a copy.

    The FP8 GEMM is ``torch._scaled_mm`` on N x N e4m3 matrices (per-tensor scales, bf16 out) with
    fast accumulation, as Triton's FP8 ``tl.dot`` runs on sm_90 by default (its
    max_num_imprecise_acc is unbounded there); the precise-accumulation figure is beside it. An
    FP8 GEMM that fails (no FP8 MMA: pre-Hopper, ROCm's e4m3fnuz) leaves its error instead."""
    if device.type != "cuda" or interpreting():
        return {}
    out = {}
    n = CEILING_GEMM_N
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    with ClockSampler(device) as clock:
        us, _ = time_fn(lambda: a @ b, use_graph=False)
    out["measured_bf16_gemm_tflops"] = 2 * n**3 / us / 1e6
    out["bf16_gemm_clock"] = clock.stats()
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # B column-major, as _scaled_mm wants
        one = torch.ones((), device=device, dtype=torch.float32)
        for key, fast in (("measured_fp8_gemm_tflops", True), ("measured_fp8_gemm_precise_tflops", False)):
            with ClockSampler(device) as clock:
                us, _ = time_fn(lambda fast=fast: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16,
                                                                   use_fast_accum=fast), use_graph=False)
            out[key] = 2 * n**3 / us / 1e6
            out[key.replace("_tflops", "_clock")] = clock.stats()
        del a8, b8
    except Exception as exc:  # noqa: BLE001 - no FP8 GEMM on this GPU: the datasheet peak stays the only one
        out["fp8_gemm_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    with ClockSampler(device) as clock:
        us, _ = time_fn(lambda: dst.copy_(src), use_graph=False)
    out["measured_copy_tbs"] = 2 * src.numel() / us / 1e6
    out["copy_clock"] = clock.stats()
    del a, b, src, dst
    torch.cuda.empty_cache()
    return out
