"""Time the sm_90a CUDA frag8 GEMMs (cuda_gemms/, research code) alone, per build variant, on synthetic fragment weights.

Research probe (not the bench): each GEMM launch captured in a CUDA graph and replayed back to back,
µs = median over rounds of (total / replays); useful TFLOP/s = 2 x pairs x K x N / time. Variants are
preprocessor switches of frag8_sm90.cu (``--defines``), so a hypothesis costs one build (seconds).
Weights / activations are random bytes in the kernels' formats (timing only; correctness is
cuda_gemms/test_gpu_cuda_gemms.py). ``--ncu`` runs one GEMM1 launch for Nsight Compute to profile.

    PYTHONPATH=.:benchmarks/research python3 benchmarks/research/cuda_gemm_probe.py --experts 192 48 --tokens 1024 8192 \\
        --variants base MM_NO_PROXY_FENCE --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.bench_experts import capture_graph
from megamoe_backend.experts.triton.layout import build_layout

from cuda_gemms.gemms import Sm90Frag8Gemms

HIDDEN, INTER, TOPK = 7168, 3072, 6


def e4m3_bytes(shape, gen, device):
    """Random finite e4m3 bytes (no 0x7F / 0xFF NaN codes)."""
    mag = torch.randint(0, 0x7E, shape, generator=gen, device=device, dtype=torch.int32)
    sign = torch.randint(0, 2, shape, generator=gen, device=device, dtype=torch.int32) << 7
    return (mag | sign).to(torch.uint8)


def fragments(e, n, k, gen, device):
    words = torch.randint(0, 256, (e, n // 16, k // 64, 32, 16), generator=gen, device=device, dtype=torch.int32).to(torch.uint8)
    fold = torch.randint(0, 12, (e, n // 16, k // 128, 8, 4, 2), generator=gen, device=device, dtype=torch.int32).to(torch.uint8)
    return words, fold, torch.ones(e, n, device=device)


def timed(fn, replays=10, rounds=5):
    """Median over rounds of µs per replay of fn's CUDA graph, ``replays`` back to back per round."""
    g = capture_graph(fn)
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1000 / replays)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, nargs="+", default=[192])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--variants", nargs="+", default=["base"], help="'base' or comma-joined defines")
    ap.add_argument("--ncu", action="store_true", help="one GEMM1 (+ one GEMM2) launch of the first case, for ncu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    results = []
    for n_exp in args.experts:
        w1 = fragments(n_exp, 2 * INTER, HIDDEN, gen, dev)
        w2 = fragments(n_exp, HIDDEN, INTER, gen, dev)
        for tokens in args.tokens:
            p = tokens * TOPK
            slot = torch.randint(0, n_exp, (p,), generator=gen, device=dev)
            row = torch.arange(tokens, device=dev).repeat_interleave(TOPK)
            layout = build_layout(slot, n_exp, 128, row=row)
            a8 = e4m3_bytes((tokens, HIDDEN), gen, dev)
            a_rs = torch.full((tokens,), 2.0**-6, device=dev)
            rows = layout.num_rows
            a2 = torch.empty(rows, INTER, dtype=torch.uint8, device=dev)
            a2s = torch.empty(rows, INTER // 32, dtype=torch.uint8, device=dev)
            a2e = e4m3_bytes((rows, INTER), gen, dev)
            a2_rs = torch.full((rows,), 2.0**-6, device=dev)
            route = torch.rand(p, generator=gen, device=dev)
            out = torch.empty(p, HIDDEN, dtype=torch.bfloat16, device=dev)
            for variant in args.variants:
                defines = () if variant == "base" else tuple(variant.split(","))
                k = Sm90Frag8Gemms._load(dev, defines)
                if isinstance(k, str):
                    raise SystemExit(f"variant {variant}: {k}")
                g1 = lambda: k.gemm1(layout, a8, a_rs, *w1, a2, a2s, HIDDEN, INTER, "fp8", 10.0)  # noqa: E731
                g2 = lambda: k.gemm2(layout, a2e, a2_rs, *w2, route, out, out.stride(0), 0, route, 1, 0,  # noqa: E731
                                     HIDDEN, INTER, "bf16")
                if args.ncu:
                    g1()
                    g2()
                    torch.cuda.synchronize()
                    return 0
                t1, t2 = timed(g1), timed(g2)
                f1, f2 = 2 * p * HIDDEN * 2 * INTER, 2 * p * INTER * HIDDEN
                r = dict(experts=n_exp, tokens=tokens, variant=variant, gemm1_us=round(t1, 1), gemm2_us=round(t2, 1),
                         gemm1_tflops=round(f1 / t1 / 1e6, 1), gemm2_tflops=round(f2 / t2 / 1e6, 1),
                         fp8_floor_us=round((f1 + f2) / 1978.9e6, 1), sum_us=round(t1 + t2, 1))
                results.append(r)
                print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "benchmarks/research/cuda_gemm_probe.py", "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
