"""FlashInfer's CUTLASS Humming MoE as the project's experts provider, measured before building one (issue 48 item 1).

Why: item 1 asks for an expert GEMM past FlashInfer Humming at the prefill buckets, and names
"FlashInfer as an optional provider where it is importable and wins" as one way. A provider runs on
the experts contract (experts/base.py): the rows a rank received and one (row, expert, weight) pair
per routed contribution in, one route-weighted row per pair out. Humming's call takes token rows with
their top-k ids and returns one route-weighted *sum* per token. Two ways to put it under the contract,
both timed here beside the project's Triton experts and Humming's own whole MoE on the same weights,
routing and GPU, one process:

- ``pairs``: every pair its own token (top-1): the pair rows gathered (bf16), Humming with k = 1, one
  bf16 row per pair out. The contract as it stands; the gather is timed apart and added.
- ``tokens``: Humming's own call on the token rows (k = top-k), a partial sum per token: what the
  contract would become if the combine carried one partial-sum row per (token, rank) (the issue's
  other suggestion); at ep_size 1 it is exactly the peer the bench times.

Both need bf16 rows (Humming quantises per token inside the call): the bf16 dispatch wire.
What it does NOT show: the memory cost of a provider that holds Humming's weights — a by-bucket mix
with the Triton provider would hold both copies.

    PYTHONPATH=.:benchmarks/research python3 benchmarks/research/flashinfer_provider_probe.py \
        --experts 48 --tokens 1024 8192 --json $OUT/flashinfer_provider_probe.json

Needs a CUDA GPU and FlashInfer (the peer build: ../shared/peers/README.md, `.peers/flashinfer/setup_device.sh`).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> int:
    from benchmarks import peers as peer_bench
    from benchmarks.bench_experts import TokenCheck, forward_call, make_routing, make_weights
    from benchmarks.references import check_tokens
    from benchmarks.timing import time_fn
    from megamoe_backend.experts import ExpertMath
    from megamoe_backend.experts.triton.provider import TritonExperts
    from megamoe_backend.experts.triton.quant import quantize_rows
    from megamoe_backend.spec import preset

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[48])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--json", default="flashinfer_provider_probe.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    spec = preset("dsv4-pro")
    hidden, inter, topk, limit = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts_per_tok, spec.swiglu_limit
    peer = peer_bench.make_peer("flashinfer_humming")
    out = {"command": "PYTHONPATH=.:benchmarks/research python3 benchmarks/research/flashinfer_provider_probe.py "
           f"--experts {' '.join(map(str, args.experts))} --tokens {' '.join(map(str, args.tokens))}",
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "peer": peer.version,
           "scope": "A8W4 (project: fp8 rows, frag8; Humming: bf16 rows, FP8 per token inside), bf16 rows out, "
                    "one CUDA graph each, back-to-back replays (bench timing.time_fn)", "cases": []}
    for n_exp in args.experts:
        fp4, bf16 = make_weights(n_exp, hidden, inter, dev, 1)
        math = ExpertMath("a8w4", limit)
        prepared = TritonExperts().prepare_weights(fp4, math)
        for t in args.tokens:
            x, pairs = make_routing(t, n_exp, topk, hidden, dev, 7 + t)
            p = len(pairs)
            check = TokenCheck(x, pairs, bf16, limit, check_tokens(t, peer_bench.CHECK_TOKENS, 0, dev))
            case = {"experts": n_exp, "tokens": t, "pairs": p}
            # the project: Triton experts on fp8 rows (the fp8 dispatch wire), bf16 rows per pair
            call = forward_call(TritonExperts(capacity=p), quantize_rows(x, "fp8"), pairs, prepared, math, "bf16")
            case["project_triton_us"] = time_fn(call, use_graph=True)[0]
            case["project_relL2"] = check.of_pairs(call(), "bf16")
            del call
            # Humming's own call on the token rows: a partial sum per token ("tokens")
            ids, w = pairs.slot.view(t, topk), pairs.weight.view(t, topk)
            r = peer_bench.run_peers([peer], fp4, peer_bench.PeerShape(hidden, inter, topk, limit), x, ids, w,
                                     check.of_tokens, max_tokens=t)[0]
            case["humming_tokens"] = _result(r)
            # every pair its own token ("pairs"): gathered bf16 rows, k = 1
            xg = torch.empty(p, hidden, dtype=torch.bfloat16, device=dev)
            torch.index_select(x, 0, pairs.row, out=xg)
            case["gather_us"] = time_fn(lambda: torch.index_select(x, 0, pairs.row, out=xg), use_graph=True)[0]  # noqa: B023
            r = peer_bench.run_peers([peer], fp4, peer_bench.PeerShape(hidden, inter, 1, limit), xg,
                                     pairs.slot.view(p, 1), pairs.weight.view(p, 1),
                                     lambda y: check.of_pairs(y.float(), "fp32"), max_tokens=p)[0]  # noqa: B023
            case["humming_pairs"] = _result(r)
            case["humming_pairs_with_gather_us"] = r.us + case["gather_us"]
            for key in ("humming_tokens", "humming_pairs"):
                us = case[key]["us"] + (case["gather_us"] if key == "humming_pairs" else 0.0)
                case[f"{key}_over_project"] = us / case["project_triton_us"]
            out["cases"].append(case)
            print(f"E{n_exp} T{t}: project {case['project_triton_us']:.0f} us (relL2 {case['project_relL2']:.4f}); "
                  f"Humming tokens {case['humming_tokens']['us']:.0f} ({case['humming_tokens_over_project']:.3f}x, "
                  f"relL2 {case['humming_tokens']['relL2']:.4f}); Humming pairs {case['humming_pairs']['us']:.0f} + "
                  f"gather {case['gather_us']:.0f} ({case['humming_pairs_over_project']:.3f}x, "
                  f"relL2 {case['humming_pairs']['relL2']:.4f})", flush=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
            del x, pairs, xg, check
        peer.release()
        del fp4, bf16, prepared
        torch.cuda.empty_cache()
    return 0


def _result(r) -> dict:
    return {"us": r.us, "us_isolated": r.us_isolated, "relL2": r.relL2, "first_call_s": r.first_call_s,
            "tactic": r.tactic, "untuned": r.untuned, "error": r.error, "stages_us": r.stages_us,
            "at": time.strftime("%H:%M:%S")}


if __name__ == "__main__":
    raise SystemExit(main())
