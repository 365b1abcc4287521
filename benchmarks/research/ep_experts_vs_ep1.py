"""The emulated EP rank's experts against the ep_size-1 experts on the SAME pairs and weights (issue 48 item 2).

Why: `bench layer --emulate` reports the EP 8 rank's experts step at 8192 tokens per rank as 7652-8078 µs
(eager, events, ranks in turn after a GPU sleep) where `bench experts` reports 7349 µs for 48 experts x 8192
tokens (sustained graph replays, other routing). Those two figures differ in timing mode, clock regime and
routing, so they cannot say whether the EP path itself costs more. This probe takes one emulated EP setup
(emulated_kernel_spans.emulated_dsv4: DSV4-Pro, A8W4 + fp8 wire, bf16 combine, MTPR 8192) and, per rank,
the tokens that reach it (bench_layer_emulated.rank_token_share, compacted) through a plain TritonExperts
forward_wire on the same weights, and measures both the same two ways:
- sustained: back-to-back graph replays (bench timing.time_fn), the whole EP step graph / ep against the
  ep_size-1 forwards of every rank's share replayed in turn / ep (the same power regime), NVML clock beside
  each, and each share's forward alone;
- profiled: kernel busy µs per rank by kernel name, both graphs through emulated_kernel_spans.graph_spans.

    PYTHONPATH=.:benchmarks/research python3 benchmarks/research/ep_experts_vs_ep1.py --tokens 8192 --json $OUT/ep_vs_ep1.json

Needs a CUDA GPU (EP 8 x 48 experts at 8192 tokens: every rank's weights, ~13 GB, and arenas on one card).
Runs so far (H100, 2026-12-06, no H200 could be started), issue 48 item 2's two measured rounds:
benchmarks/results/h100_pdl_rescale_ab.json and h100_layout_spans_ab.json, benchmarks/research/NOTEBOOK.md part 2 (the issue 48 sections).
A kernel launched more than once per step is split by launch order (graph_spans): frag8's re-scales read as
``rowscale_e4m3_kernel [1/2]`` (A, received rows) and ``[2/2]`` (A2, sorted pair rows). With PDL on, a kernel's
busy time includes its wait for its predecessor; ``--no-pdl`` launches both forwards without it, for kernel times.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def share_pairs(routes, rank: int, experts: int):
    """(x rows of the tokens that reach ``rank``, their ExpertPairs with local slots): what the rank receives."""
    from benchmarks.bench_layer_emulated import rank_share
    from megamoe_backend.experts import ExpertPairs

    xs, lid, w, tok = rank_share(routes, rank, experts)
    uniq, row = torch.unique(tok, return_inverse=True)
    return xs[uniq], ExpertPairs(row=row.contiguous(), slot=lid.contiguous(), weight=w.contiguous())


def main() -> int:
    from emulated_kernel_spans import emulated_dsv4, graph_spans

    from benchmarks.bench_experts import capture_graph, forward_call
    from benchmarks.bench_layer_emulated import make_routes
    from benchmarks.gpu_clock import ClockSampler
    from benchmarks.timing import time_fn
    from megamoe_backend.experts import ExpertMath
    from megamoe_backend.experts.triton.provider import TritonExperts
    from megamoe_backend.experts.triton.quant import quantize_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default="ep_experts_vs_ep1.json")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch without programmatic dependent launch (each kernel's busy time then excludes its wait)")
    args = ap.parse_args()
    if args.no_pdl:  # the forward's one PDL decision (ForwardLaunch.pdl), answered "off" for this process
        from megamoe_backend.experts.triton import launches

        launches.pdl_launch = lambda device: False
    dev = torch.device("cuda")
    spec, emu = emulated_dsv4(args.ep, args.experts, dev)
    math = ExpertMath("a8w4", spec.swiglu_limit)
    out = {"command": "PYTHONPATH=.:benchmarks/research python3 benchmarks/research/ep_experts_vs_ep1.py "
           f"--ep {args.ep} --experts {args.experts} --tokens {' '.join(map(str, args.tokens))} --iters {args.iters}"
           + (" --no-pdl" if args.no_pdl else ""),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for t in args.tokens:
        routes = make_routes("uniform", [t] * args.ep, args.ep * args.experts, spec.num_experts_per_tok,
                             spec.hidden_size, dev, seed=t)
        case = {"ep": args.ep, "experts": args.experts, "tokens": t, "bounded": True}
        # the EP step, bound passed: one graph of every rank's steps in turn
        g = capture_graph(lambda: emu.forward(routes, t))  # noqa: B023
        with ClockSampler(dev) as clock:
            us, _ = time_fn(g.replay, use_graph=False)
        case["ep_step_graph_us_per_rank"] = us / args.ep
        case["ep_clock"] = clock.stats()
        spans = graph_spans(g, args.ep, args.iters)  # the same graph, profiled
        case["ep_kernels_busy_us_per_rank"] = {n: k["busy_us"] for n, k in spans["kernels"].items()}
        case["ep_span_us_per_rank"] = spans["span_us_per_rank"]
        del g
        # the ep_size-1 experts on each rank's share, on that rank's own prepared weights (the same tensors), all ep
        # forwards in one graph, in turn, as the EP step runs its ranks (the same power regime), profiled the same way
        calls, pairs_by_rank = [], []
        for r in range(args.ep):
            x, pairs = share_pairs(routes, r, args.experts)
            a = quantize_rows(x, "fp8")
            calls.append(forward_call(TritonExperts(capacity=int(pairs.slot.numel())), a, pairs, emu.layers[r].weights,
                                      math, "bf16"))
            pairs_by_rank.append(int(pairs.slot.numel()))
        seq = capture_graph(lambda: [call() for call in calls])  # noqa: B023
        with ClockSampler(dev) as clock:
            us, _ = time_fn(seq.replay, use_graph=False)
        case["ep1_sequence_us_per_rank"] = us / args.ep
        case["ep1_clock"] = clock.stats()
        ep1_us = [time_fn(call, use_graph=True)[0] for call in calls]
        ep1_busy = {n: k["busy_us"] for n, k in graph_spans(seq, args.ep, args.iters)["kernels"].items()}
        case.update(ep1_us_by_rank=ep1_us, ep1_us_mean=statistics.mean(ep1_us), pairs_by_rank=pairs_by_rank,
                    ep1_kernels_busy_us_per_rank=ep1_busy)
        del seq, calls
        torch.cuda.empty_cache()
        case["step_graph_over_ep1_sequence"] = case["ep_step_graph_us_per_rank"] / case["ep1_sequence_us_per_rank"]
        out["cases"].append(case)
        print(f"T={t}: EP step graph / rank {case['ep_step_graph_us_per_rank']:.0f} us "
              f"(clock {case['ep_clock'].get('sm_mhz_median')}) vs the ep1 experts of every share in turn / rank "
              f"{case['ep1_sequence_us_per_rank']:.0f} (clock {case['ep1_clock'].get('sm_mhz_median')}): "
              f"{case['step_graph_over_ep1_sequence']:.3f}x; ep1 alone by rank {[round(u) for u in ep1_us]}", flush=True)
        names = sorted(set(case["ep_kernels_busy_us_per_rank"]) | set(ep1_busy),
                       key=lambda n: -max(case["ep_kernels_busy_us_per_rank"].get(n, 0), ep1_busy.get(n, 0)))
        for n in names[:16]:
            print(f"   {n:60s} EP {case['ep_kernels_busy_us_per_rank'].get(n, 0):8.1f}  ep1 {ep1_busy.get(n, 0):8.1f}")
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
