"""Why the EP forward without a bound is slower at prefill sizes: scheduling of the persistent grid, or its code?

Why: `bench layer --emulate` (tree fab60c7) has the unbounded forward at 1.25-1.35x the bounded one
for EP 2 / 8192 tokens and 1.2-1.3x for EP 8 / 2048 tokens, where the live rows fill (or nearly fill)
the region, so both run the same tile config on about the same tiles. The difference left is the
GEMM launch: the bounded forward runs one program per tile (the hardware hands out tiles in order),
the unbounded one a fixed grid of about one resident wave whose programs walk the live tiles
(launch_plan.persistent_grid, mainloop.persistent_items: a static stride up to tree bbcdfcf, claimed in
order from a shared counter since). This times one emulated step (every rank, in
one CUDA graph, profiled per kernel as emulated_kernel_spans.py does) with the persistent grid at its
default size, at 4x that size, and at the region's full tile count (every candidate config's launch
at the region's size, so mostly programs with no item: it prices those, not the scheduling), through
the providers' GridPolicy(gemm_waves=1 / 4 / inf). Same capacity (MTPR 8192) for all.

    PYTHONPATH=.:benchmarks/research python3 benchmarks/research/persistent_grid_ab.py --json $OUT/persistent_grid_ab.json

DSV4-Pro shapes, A8W4 + fp8 wire, bf16 combine, uniform routing; needs a CUDA GPU.
"""

from __future__ import annotations

import json

import torch

VARIANTS = ("bounded", "persistent x1", "persistent x4", "persistent, region grid")
WAVES = {"bounded": 1.0, "persistent x1": 1.0, "persistent x4": 4.0, "persistent, region grid": float("inf")}


def main() -> int:
    from emulated_kernel_spans import ab_cli, emulated_dsv4, gemm_round

    from benchmarks.bench_layer_emulated import make_routes
    from megamoe_backend.experts.triton.launch_plan import GridPolicy

    args, out = ab_cli("persistent_grid_ab", ["2x192x8192", "8x48x2048", "8x48x8"], VARIANTS)
    device = torch.device("cuda")
    for case in args.cases:
        ep, experts, tokens = (int(v) for v in case.split("x"))
        spec, emu = emulated_dsv4(ep, experts, device)
        routes = make_routes("uniform", [tokens] * ep, ep * experts, spec.num_experts_per_tok, spec.hidden_size, device,
                             seed=tokens)
        rows = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for v in VARIANTS:
                rows[v].append(gemm_round(f"{case} {v}", emu, routes, tokens if v == "bounded" else None,
                                          GridPolicy(gemm_waves=WAVES[v])))
        best = {v: min(r["span_us_per_rank"] for r in rows[v]) for v in VARIANTS}
        out["cases"].append({"ep": ep, "experts": experts, "tokens": tokens, "rounds": rows, "best_span_us_per_rank": best,
                             "over_bounded": {v: best[v] / best["bounded"] for v in VARIANTS}})
        print(json.dumps({"case": case, "over_bounded": out["cases"][-1]["over_bounded"]}), flush=True)
        del emu
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
