"""Where one emulated EP step goes, kernel by kernel: bound passed or not (issue 32's 1.2x target).

Why: `bench layer --emulate` times each rank's steps with events; the experts half without a bound
costs ~100 µs more than with it at 8 tokens per rank (EP 8), and events cannot say which launches
that is. This captures the whole emulated step (every rank, in turn) in one CUDA graph, profiles a
few replays and sums kernel time and the gaps before each kernel by kernel name, per rank (/ ep).

    PYTHONPATH=. python3 benchmarks/research/emulated_kernel_spans.py --tokens 8 32 128 --json $OUT/spans.json

DSV4-Pro shapes, 48 local experts (EP 8), A8W4 + fp8 wire, bf16 combine, uniform routing,
MEGA_MAX_TOKENS_PER_RANK 8192; needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch


def profile_step(emu, routes, bound, replays: int = 5) -> dict:
    from benchmarks.bench_experts import capture_graph

    return graph_spans(capture_graph(lambda: emu.forward(routes, bound)), emu.ep, replays)


def graph_spans(g, ranks: int, replays: int = 5) -> dict:
    """Span, busy and gap µs per rank of graph ``g`` (``ranks`` ranks' work per replay), by kernel name.

    A kernel launched n > 1 times per rank step is split by launch order, ``name [i/n]`` (frag8's two
    row re-scales, A then A2, share one kernel; issue 48 needed them apart): every rank's step makes
    the same launches in the same order, so the i-th launch of a name within a step is the same job."""
    from graph_replay_spans import profiled_kernels

    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    evs = profiled_kernels(g, replays)
    per = ranks * replays
    per_step = defaultdict(int)
    for e in evs:
        per_step[e.name[:60]] += 1
    busy, gaps, count, seen = defaultdict(float), defaultdict(float), defaultdict(int), defaultdict(int)
    last_end = None
    for e in evs:
        name = raw = e.name[:60]
        n = per_step[raw] // per if per_step[raw] % per == 0 else 1
        if n > 1:
            name = f"{raw} [{seen[raw] % n + 1}/{n}]"
            seen[raw] += 1
        busy[name] += e.time_range.elapsed_us()
        count[name] += 1
        if last_end is not None:
            gaps[name] += max(0.0, e.time_range.start - last_end)
        last_end = e.time_range.end
    span = (evs[-1].time_range.end - evs[0].time_range.start) / per if evs else 0.0
    kernels = {n: {"launches": count[n] / per, "busy_us": busy[n] / per, "gap_before_us": gaps[n] / per} for n in busy}
    return {"span_us_per_rank": span, "busy_us_per_rank": sum(busy.values()) / per,
            "gaps_us_per_rank": sum(gaps.values()) / per, "launches_per_rank": sum(count.values()) / per,
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["busy_us"] - kv[1]["gap_before_us"]))}


MTPR = 8192


def emulated_dsv4(ep: int, experts: int, device):
    """(spec, EmulatedEP) of DSV4-Pro scaled to ep x experts (A8W4 + fp8 wire, bf16 combine, MTPR 8192):
    the one setup this probe, persistent_grid_ab.py and bounded_grid_ab.py time. Its providers are this
    probe's own (grid_experts, as the layer would build them), so gemm_round can hand them a GridPolicy."""
    from benchmarks.bench_experts import make_weights
    from benchmarks.bench_layer import SCHEMES
    from benchmarks.emulated_ep import EmulatedEP
    from megamoe_backend.knobs import Knobs
    from megamoe_backend.plan import build_plan
    from megamoe_backend.spec import preset

    spec = preset("dsv4-pro").scaled(n_routed_experts=ep * experts)
    weights = [make_weights(experts, spec.hidden_size, spec.moe_intermediate_size, device, 1 + r)[0] for r in range(ep)]
    knobs = Knobs(dispatch_wire=SCHEMES["a8w4"], combine_wire="bf16", max_tokens_per_rank=MTPR, transport="ipc")
    plans = [build_plan(spec, knobs, r, ep, quant="a8w4", backends=("triton", "ipc")) for r in range(ep)]
    capacity = MTPR * spec.num_experts_per_tok * ep  # what registry.make_provider gives the layer's own provider
    return spec, EmulatedEP(ep, plans.__getitem__, weights.__getitem__, device,
                            provider_for=lambda r: grid_experts(capacity))


def grid_experts(capacity: int):
    """A TritonExperts whose forwards plan their launches with its ``grids`` (a launch_plan.GridPolicy, set
    by gemm_round): the product's provider runs the measured defaults only."""
    from megamoe_backend.experts.triton import TritonExperts
    from megamoe_backend.experts.triton.launch_plan import DEFAULT_GRIDS, plan_launches

    class GridExperts(TritonExperts):
        grids = DEFAULT_GRIDS

        def _launch_plan(self, mode, pairs, weights, live, device):
            return plan_launches(self.config, pairs, weights.num_experts, mode, live, device, self.grids)

    return GridExperts(capacity=capacity)


def gemm_round(label: str, emu, routes, bound, grids=None) -> dict:
    """One profiled step of an A/B probe: its span per rank and its GEMM kernels, printed on one line.
    ``grids``: the launch_plan.GridPolicy the ranks' providers run this step with (None: the defaults)."""
    from megamoe_backend.experts.triton.launch_plan import DEFAULT_GRIDS

    for layer in emu.layers:  # the probe's own providers (emulated_dsv4): the policy is theirs, not a global
        layer.provider.grids = grids or DEFAULT_GRIDS
    spans = profile_step(emu, routes, bound)
    gemm = {n: k for n, k in spans["kernels"].items() if "gemm" in n}
    print(f"{label:36s} span {spans['span_us_per_rank']:8.1f} us/rank  "
          + "  ".join(f"{n.split('_kernel')[0]} {k['busy_us']:.1f}" for n, k in gemm.items()), flush=True)
    return {"span_us_per_rank": spans["span_us_per_rank"], "gemm_kernels": gemm}


def ab_cli(script: str, default_cases: list[str], variants) -> tuple[argparse.Namespace, dict]:
    """(args, the JSON's header) of an A/B probe over emulated EP cases ("EPxEXPERTSxTOKENS", --rounds
    interleaved rounds): the command line persistent_grid_ab.py and bounded_grid_ab.py share."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=default_cases, help="EPxEXPERTSxTOKENS")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=f"{script}.json")
    args = ap.parse_args()
    out = {"command": f"PYTHONPATH=.:benchmarks/research python3 benchmarks/research/{script}.py --cases "
           + " ".join(args.cases) + f" --rounds {args.rounds}",
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": list(variants), "cases": []}
    return args, out


def main() -> int:
    from benchmarks.bench_layer_emulated import make_routes

    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--json", default="emulated_kernel_spans.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    spec, emu = emulated_dsv4(args.ep, args.experts, device)
    out = {"command": "PYTHONPATH=. python3 benchmarks/research/emulated_kernel_spans.py " + " ".join(
        f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for t in args.tokens:
        routes = make_routes("uniform", [t] * args.ep, args.ep * args.experts, spec.num_experts_per_tok,
                             spec.hidden_size, device, seed=t)
        for bound in (t, None):
            spans = profile_step(emu, routes, bound)
            out["cases"].append({"tokens": t, "bounded": bound is not None, **spans})
            print(f"T={t} bounded={bound is not None}: span {spans['span_us_per_rank']:.0f} busy "
                  f"{spans['busy_us_per_rank']:.0f} gaps {spans['gaps_us_per_rank']:.0f} launches "
                  f"{spans['launches_per_rank']:.0f}", flush=True)
            for name, k in list(spans["kernels"].items())[:14]:
                print(f"   {k['launches']:4.1f} x {name:60s} busy {k['busy_us']:7.1f} gap {k['gap_before_us']:6.1f}")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
