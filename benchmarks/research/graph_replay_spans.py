"""One experts forward captured as a CUDA graph, timed three ways: back to back, isolated, profiled.

Why: the bench (back-to-back replays) and short profiled runs disagree by ~10 %. This shows where
the time goes inside a replay (kernel durations, gaps between kernels, span = first start to last
end) and how the same graph times when replayed back to back or after a GPU sleep. Run it beside
nvidia-smi to see the clock of each phase (docs/triton.md, "Sustained runs are power-capped"):

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active \\
        --format=csv -lms 50 > $OUT/smi.csv &
    PYTHONPATH=. python3 benchmarks/research/graph_replay_spans.py     # $OUT/graph_replay_spans.json, $OUT/marks.txt

marks.txt holds the wall-clock start of each phase, to cut the nvidia-smi log. 192 experts, a8w4,
DSV4-Pro shapes, bucket-default tiles; needs a CUDA GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def _mark(f, what: str) -> None:
    now = time.time()
    f.write(f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now * 1000) % 1000:03d} {what}\n")
    f.flush()


def profiled_kernels(g, n: int) -> list:
    """The CUDA events (kernels, copies) of ``n`` replays of graph ``g`` under the torch profiler, by start."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            g.replay()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def _profiled_replays(g, n: int) -> tuple[list[dict], list[float]]:
    """Per replay: span, busy (sum of kernel times), kernels and the gaps before each; and the gaps
    between replays. Replays are split at each recurrence of the first kernel's name."""
    evs = profiled_kernels(g, n)
    replays, cur = [], []
    for ev in evs:
        if ev.name == evs[0].name and cur:
            replays.append(cur)
            cur = []
        cur.append(ev)
    replays.append(cur)
    rows = []
    for rp in replays:
        rows.append({
            "span": round(rp[-1].time_range.end - rp[0].time_range.start, 1),
            "busy": round(sum(e.time_range.end - e.time_range.start for e in rp), 1),
            "kernels": [(e.name[:24], round(e.time_range.end - e.time_range.start, 1)) for e in rp],
            "gaps": [(rp[i + 1].name[:24], round(rp[i + 1].time_range.start - rp[i].time_range.end, 1))
                     for i in range(len(rp) - 1)],
        })
    between = [round(replays[i + 1][0].time_range.start - replays[i][-1].time_range.end, 1)
               for i in range(len(replays) - 1)]
    return rows, between


def main() -> int:
    if not torch.cuda.is_available():
        print("graph_replay_spans needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks.bench_experts import capture_graph, make_routing, make_weights, time_fn, time_isolated
    from megamoe_backend.experts import ExpertMath
    from megamoe_backend.experts.triton.provider import TritonExperts
    from megamoe_backend.experts.triton.quant import quantize_rows

    dev = torch.device("cuda")
    out_dir = os.environ.get("OUT", ".")
    fp4, _ = make_weights(192, 7168, 3072, dev, 0)
    math = ExpertMath("a8w4", 10.0)
    weights = TritonExperts().prepare_weights(fp4, math)
    del fp4
    out = {}
    with open(os.path.join(out_dir, "marks.txt"), "w") as marks:
        for tokens in (1024, 8192):
            x, pairs = make_routing(tokens, 192, 6, 7168, dev, tokens)
            a = quantize_rows(x, "fp8")
            prov = TritonExperts(capacity=len(pairs))
            fn = lambda: prov.forward(a, pairs, weights, math)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            g = capture_graph(fn)
            res = {}
            _mark(marks, f"{tokens} graph_b2b")
            res["graph_b2b"] = [round(time_fn(g.replay, False)[0], 1) for _ in range(3)]  # the bench's timing
            res["graph_isolated"] = time_isolated(g.replay)  # events around one replay after ~3 ms of GPU sleep
            _mark(marks, f"{tokens} prof")
            res["profiled_replays"], res["between_replays"] = _profiled_replays(g, 8)
            _mark(marks, f"{tokens} done")
            out[tokens] = res
            print(tokens, json.dumps({k: v for k, v in res.items() if k != "profiled_replays"}), flush=True)
    with open(os.path.join(out_dir, "graph_replay_spans.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
