"""One experts forward timed four ways in one process, each with the SM clock NVML saw meanwhile.

Why: `megamoe bench experts` (median of CUDA-graph replays, ~60 ms of back-to-back forwards per
sample) and `benchmarks/research/profile_experts.py` (torch.profiler kernel sums over a few eager forwards) have
disagreed by 8-19 % for the same kernels (docs/triton.md); a tile that wins in one can tie in the
other. Modes per case, each twice: ``graph`` / ``eager`` (the bench's time_fn with / without a
graph), ``burstN`` (events around N eager forwards after 5 ms of GPU sleep), ``prof6`` (profiler
kernel sum over 6 forwards). Each mode's median / min SM MHz and power-capped fraction is stored
beside its time (benchmarks/gpu_clock.py): on the H200 here sustained modes run with the SW power cap set
(~1550-1700 MHz), measurements right after an idle gap mostly without, and the cap state is what
separates fast from slow (docs/triton.md). 192 experts, a8w4, DSV4-Pro shapes; needs a CUDA GPU.

    PYTHONPATH=. python3 benchmarks/research/timing_modes.py                # writes $OUT/timing_modes.json (or ./)
"""

from __future__ import annotations

import json
import os
import sys

import torch


def _burst(fn, n: int) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(10_000_000)  # ~5 ms of GPU work first: every burst starts from the same state
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def _profiled(fn, n: int) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return sum(ev.device_time for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA) / n


def main() -> int:
    if not torch.cuda.is_available():
        print("timing_modes needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks.bench_experts import make_routing, make_weights, time_fn
    from benchmarks.gpu_clock import ClockSampler
    from megamoe_backend.experts import ExpertMath
    from megamoe_backend.experts.triton.config import TileConfig
    from megamoe_backend.experts.triton.provider import TritonExperts
    from megamoe_backend.experts.triton.quant import quantize_rows

    dev = torch.device("cuda")
    fp4, _ = make_weights(192, 7168, 3072, dev, 0)
    math = ExpertMath("a8w4", 10.0)
    weights = TritonExperts().prepare_weights(fp4, math)
    del fp4
    cases = {  # tokens -> (name, config or None = bucket default)
        1024: (("default", None), ("bn256", TileConfig(64, 256, 256, 128, 4, 3, 4, 32))),
        8192: (("default", None), ("s4", TileConfig(128, 128, 128, 128, 4, 4, 4, 16))),
    }
    out = {"fields": "mode_rep: us; mode_rep_clock: [median SM MHz, min SM MHz, fraction of samples power-capped]"}
    for tokens, configs in cases.items():
        x, pairs = make_routing(tokens, 192, 6, 7168, dev, tokens)
        a = quantize_rows(x, "fp8")
        for name, cfg in configs:
            prov = TritonExperts(capacity=len(pairs), config=cfg)
            fn = lambda: prov.forward(a, pairs, weights, math)  # noqa: E731
            res = {}

            def measure(key: str, f) -> None:
                with ClockSampler(dev, period_s=0.005) as clock:
                    res[key] = round(f(), 1)
                st = clock.stats()
                if st:
                    res[key + "_clock"] = [st["sm_mhz_median"], st["sm_mhz_min"], st["power_capped_frac"]]

            for rep in range(2):
                measure(f"graph_{rep}", lambda: time_fn(fn, True)[0])
                measure(f"eager_{rep}", lambda: time_fn(fn, False)[0])
                for n in (1, 6, 40):
                    measure(f"burst{n}_{rep}", lambda: _burst(fn, n))
                measure(f"prof6_{rep}", lambda: _profiled(fn, 6))
            out[f"{tokens}_{name}"] = res
            print(tokens, name, json.dumps(res), flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "timing_modes.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
