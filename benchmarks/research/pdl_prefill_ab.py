"""The ep_size-1 experts at prefill with and without programmatic dependent launch, in one process (issue 48).

Why: after issue 48's PDL change (efe5d6a) and layout spans (9be2b92), the H100 peer run of 2026-12-06
15:44 UTC put the 48 x 8192 experts 3.7 % further behind FlashInfer Humming than the run of 228d517
(7502 vs 7207 µs; Humming 6649 vs 6625), with the clocks of both runs power-capped. PDL was measured
within 0.3 % on the emulated EP 8 step at 8192 tokens, never on the ep_size-1 experts. Every PDL
program calls ``gdc_launch_dependents`` right after its wait (pdl.pdl_enter), so the next kernel's
programs may sit on SMs in their wait during a long GEMM's last wave; this probe says whether that
costs anything. Two CUDA graphs of the same forward (same weights, routing, buffers), one captured
with PDL and one without (``launches.pdl_launch`` answered "off" while capturing), replayed in turn;
outputs compared bit for bit.

    PYTHONPATH=. python3 benchmarks/research/pdl_prefill_ab.py --experts 48 --tokens 1024 8192 \
        --json $OUT/pdl_prefill_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> int:
    from benchmarks.bench_experts import forward_call, make_routing, make_weights
    from benchmarks.gpu_clock import ClockSampler
    from benchmarks.timing import capture_graph, time_fn
    from megamoe_backend.experts import ExpertMath
    from megamoe_backend.experts.triton import launches
    from megamoe_backend.experts.triton.provider import TritonExperts
    from megamoe_backend.experts.triton.quant import quantize_rows
    from megamoe_backend.spec import preset

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default="pdl_prefill_ab.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    spec = preset("dsv4-pro")
    fp4, _ = make_weights(args.experts, spec.hidden_size, spec.moe_intermediate_size, dev, 1)
    math = ExpertMath("a8w4", spec.swiglu_limit)
    prepared = TritonExperts().prepare_weights(fp4, math)
    out = {"command": f"PYTHONPATH=. python3 benchmarks/research/pdl_prefill_ab.py --experts {args.experts} "
                      f"--tokens {' '.join(map(str, args.tokens))} --rounds {args.rounds}",
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    pdl_of_device = launches.pdl_launch
    for t in args.tokens:
        x, pairs = make_routing(t, args.experts, spec.num_experts_per_tok, spec.hidden_size, dev, 7 + t)
        call = forward_call(TritonExperts(capacity=len(pairs)), quantize_rows(x, "fp8"), pairs, prepared, math, "bf16")
        graphs, outs = {}, {}
        for name, pdl in (("pdl", pdl_of_device), ("no_pdl", lambda device: False)):
            launches.pdl_launch = pdl
            held = {}  # the captured call's output tensor: the graph's replays write it
            try:
                graphs[name] = capture_graph(lambda: held.__setitem__("y", call()))  # noqa: B023
            finally:
                launches.pdl_launch = pdl_of_device
            outs[name] = held["y"]
        replayed = {}
        for name, g in graphs.items():  # both graphs write the provider's one set of buffers: copy each out
            g.replay()
            replayed[name] = outs[name].clone()
        torch.cuda.synchronize()
        case = {"experts": args.experts, "tokens": t, "pairs": len(pairs),
                "bits_equal": bool(torch.equal(replayed["pdl"], replayed["no_pdl"])), "us": {"pdl": [], "no_pdl": []},
                "clock_mhz": {"pdl": [], "no_pdl": []}}
        for r in range(args.rounds):
            order = ("pdl", "no_pdl") if r % 2 == 0 else ("no_pdl", "pdl")  # interleaved: neither always runs hotter
            for name in order:
                with ClockSampler(dev) as clock:
                    us, _ = time_fn(graphs[name].replay, use_graph=False)
                case["us"][name].append(us)
                case["clock_mhz"][name].append(clock.stats().get("sm_mhz_median"))
        med = {k: statistics.median(v) for k, v in case["us"].items()}
        case["median_us"], case["pdl_over_no_pdl"] = med, med["pdl"] / med["no_pdl"]
        out["cases"].append(case)
        print(f"E{args.experts} T{t}: PDL {med['pdl']:.1f} us, no PDL {med['no_pdl']:.1f} us "
              f"({case['pdl_over_no_pdl']:.4f}x), bits equal {case['bits_equal']}, "
              f"rounds {case['us']}, clocks {case['clock_mhz']}", flush=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        del graphs, outs, replayed, call, x, pairs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
