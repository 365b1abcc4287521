"""With a bound passed, should the expert GEMMs run one program per tile of the region, or persistent grids?

Why: a bounded EP forward receives into ep x bound rows (any source may send all its tokens to one
rank), and its GEMMs launched one program per tile of that worst case. At EP 8 prefill that is ~7x the
tiles a uniform step fills, and `bench layer --emulate` (tree 06dd430) had the bounded forward
slower than the unbounded one, whose persistent grids walk only the live tiles: EP 8 / 8192 tokens
experts 9140 vs 8395 us, while at EP 2 / 8192 the tile grid won (8257 vs 8945). This times one
emulated step (every rank in one CUDA graph, profiled per kernel as emulated_kernel_spans.py does)
three ways: bounded over the tile grid, bounded over persistent grids (launch_plan.persistent_gemms forced
either way by the providers' GridPolicy(bounded_persist_ratio=inf / 0)), and without a bound (the persistent
candidates), to place the ratio of region tiles to the bound's tiles from which persistent grids win.

    PYTHONPATH=.:benchmarks/research python3 benchmarks/research/bounded_grid_ab.py --json $OUT/bounded_grid_ab.json

DSV4-Pro shapes, A8W4 + fp8 wire, bf16 combine, uniform routing, MTPR 8192; needs a CUDA GPU.
An A/B of the same kernels: the naive torch baseline and floor of these points are in the
`bench layer --emulate` runs (benchmarks/results/h200_layer_ep_emulated*.json).
"""

from __future__ import annotations

import json
import time

import torch

VARIANTS = ("tile grid", "persistent", "no bound")
RATIO = {"tile grid": float("inf"), "persistent": 0.0, "no bound": None}  # None: the measured default


def grids_of(variant: str):
    """The providers' GridPolicy of one variant (launch_plan.py)."""
    from megamoe_backend.experts.triton.launch_plan import DEFAULT_GRIDS, GridPolicy

    ratio = RATIO[variant]
    return DEFAULT_GRIDS if ratio is None else GridPolicy(bounded_persist_ratio=ratio)


def main() -> int:
    from emulated_kernel_spans import ab_cli, emulated_dsv4, gemm_round

    from benchmarks.bench_layer_emulated import make_routes
    from megamoe_backend.experts.triton.config import default_config
    from megamoe_backend.experts.triton.layout import max_tiles

    args, out = ab_cli("bounded_grid_ab", ["8x48x8", "8x48x32", "8x48x128", "8x48x512", "8x48x2048", "8x48x8192",
                                           "2x192x8", "2x192x128", "2x192x2048", "2x192x8192"], VARIANTS)
    device = torch.device("cuda")
    started = time.time()
    built = {}  # (ep, experts) -> (spec, EmulatedEP): its weights serve every token count
    for case in args.cases:
        ep, experts, tokens = (int(v) for v in case.split("x"))
        if (ep, experts) not in built:
            built.clear()
            torch.cuda.empty_cache()
            built[(ep, experts)] = emulated_dsv4(ep, experts, device)
        spec, emu = built[(ep, experts)]
        k = spec.num_experts_per_tok
        routes = make_routes("uniform", [tokens] * ep, ep * experts, k, spec.hidden_size, device, seed=tokens)
        block_m = default_config(tokens * k, experts, "frag8").block_m
        region_tiles, bound_tiles = max_tiles(ep * tokens * k, experts, block_m), max_tiles(tokens * k, experts, block_m)
        rows = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for v in VARIANTS:
                rows[v].append(gemm_round(f"{case} {v}", emu, routes, None if v == "no bound" else tokens, grids_of(v)))
        best = {v: min(r["span_us_per_rank"] for r in rows[v]) for v in VARIANTS}
        out["cases"].append({"ep": ep, "experts": experts, "tokens": tokens, "block_m": block_m,
                             "region_tiles": region_tiles, "bound_tiles": bound_tiles,
                             "region_over_bound_tiles": region_tiles / bound_tiles, "rounds": rows,
                             "best_span_us_per_rank": best,
                             "over_tile_grid": {v: best[v] / best["tile grid"] for v in VARIANTS}})
        print(json.dumps({"case": case, "region_over_bound_tiles": region_tiles / bound_tiles,
                          "over_tile_grid": out["cases"][-1]["over_tile_grid"]}), flush=True)
    out["seconds"] = time.time() - started
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
