"""A/B: the ep_size-1 layer with its experts' intermediates in the workspace's ExpertsScratch (reserved
at capacity once) against the same layer taking them from the caching allocator per forward.

Why: issue 32 says the ep_size-1 figures of `bench layer` must not get worse by more than 3 %; a
bench run on another day moves by 1-3 % on its own (the experts alone, which the scratch does not
touch, moved +1 %), so the two ways are timed here in one process, interleaved, on the same routes.

    PYTHONPATH=. python3 benchmarks/research/scratch_ab.py --cases 192x1024 48x8192 --json $OUT/scratch_ab.json

DSV4-Pro shapes, A8W4 + fp8 wire, bf16 combine, MEGA_MAX_TOKENS_PER_RANK 8192; needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> int:
    from benchmarks.bench_experts import capture_graph, make_weights, slice_weights
    from benchmarks.bench_layer import Routes, replay_us
    from megamoe_backend.knobs import Knobs
    from megamoe_backend.layer import MegaMoELayer
    from megamoe_backend.plan import build_plan
    from megamoe_backend.spec import preset
    from megamoe_backend.transport import clear_transport_cache

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["192x1024", "48x8192"], help="EXPERTSxTOKENS")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default="scratch_ab.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    spec = preset("dsv4-pro")
    most = max(int(c.split("x")[0]) for c in args.cases)
    fp4_all, _ = make_weights(most, spec.hidden_size, spec.moe_intermediate_size, device, 0)
    out = {"command": "PYTHONPATH=. python3 benchmarks/research/scratch_ab.py --cases " + " ".join(args.cases)
           + f" --rounds {args.rounds}", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for case in args.cases:
        n_exp, tokens = (int(v) for v in case.split("x"))
        clear_transport_cache()
        plan = build_plan(spec.scaled(n_routed_experts=n_exp), Knobs(dispatch_wire="fp8", combine_wire="bf16",
                                                                      max_tokens_per_rank=8192),
                          quant="a8w4", device_type="cuda")
        layer = MegaMoELayer(plan, slice_weights(fp4_all, n_exp), device=device)
        routes = Routes(tokens, n_exp, plan.topk, plan.hidden, device, 0)
        ws = layer.workspace
        layer(routes.x, routes.ids, routes.w)  # compiles; the scratch is reserved here
        with_scratch = capture_graph(lambda: layer(routes.x, routes.ids, routes.w))  # noqa: B023
        ws.scratch, kept = None, ws.scratch
        per_call = capture_graph(lambda: layer(routes.x, routes.ids, routes.w))  # noqa: B023
        ws.scratch = kept
        a, b = [], []
        for _ in range(args.rounds):
            a.append(replay_us(with_scratch))
            b.append(replay_us(per_call))
        row = {"experts": n_exp, "tokens": tokens, "scratch_us": a, "per_call_alloc_us": b,
               "scratch_median_us": statistics.median(a), "per_call_median_us": statistics.median(b),
               "scratch_over_per_call": statistics.median(a) / statistics.median(b)}
        out["cases"].append(row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}), flush=True)
        del with_scratch, per_call, layer
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
