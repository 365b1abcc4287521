"""Issue 61 round 2: the block-FP8 Triton experts' tile table (config.BLOCK_FP8_BUCKETS) against other tiles.

    PYTHONPATH=. python3 benchmarks/research/block_fp8_tiles.py --out tiles.json [--experts 32]
        [--tokens 1024 8192] [--deadline-s 240]

Per token bucket (DeepSeek V3 expert shapes by default: hidden 7168, intermediate 2048, top-8, uniform
random routing), the default tile of the bucket and each candidate of ``CANDIDATES`` run the same forward
(bf16 combine rows, TritonExperts with ``config=``), captured in one CUDA graph and timed as the benches time
(benchmarks/timing.py); each candidate's rows are compared bit for bit with the default's (the K order per
output row does not depend on the tile, so they must be equal) and its relL2 against fp32 on the dequantised
weights is recorded. TFLOP/s are dense-equivalent (2 x pairs x 3 x hidden x intermediate). The JSON is
rewritten after every case, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

CANDIDATES = [  # (block_m, block_n1, block_n2, num_warps, num_stages, group_m): block_k is 128 (one weight block)
    (64, 256, 128, 8, 3, 4), (64, 256, 256, 8, 3, 4), (128, 256, 128, 8, 3, 4), (128, 256, 128, 8, 4, 4),
    (128, 256, 256, 8, 3, 4), (128, 256, 128, 4, 3, 4), (128, 512, 128, 8, 3, 4), (256, 256, 128, 8, 3, 4),
    (128, 256, 128, 8, 3, 8), (64, 256, 128, 4, 4, 4), (32, 256, 128, 4, 4, 4),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--deadline-s", type=float, default=240.0)
    args = ap.parse_args()

    from benchmarks.bench_experts import make_block_fp8_weights, make_routing, make_weights
    from benchmarks.references import check_subset, subset_reference
    from benchmarks.timing import capture_graph, time_fn
    from megamoe_backend.experts import ExpertMath
    from megamoe_backend.experts.triton import TritonExperts
    from megamoe_backend.experts.triton.config import TileConfig, default_config
    from megamoe_backend.experts.triton.quant import quantize_rows
    from megamoe_backend.formats.wire import combine_wire
    from megamoe_backend.layer.reference import rel_l2

    t0 = time.time()
    dev = torch.device("cuda")
    rec: dict = {"args": vars(args), "gpu": torch.cuda.get_device_name(dev), "buckets": []}

    def save():
        rec["wall_s"] = round(time.time() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1, default=str)

    _, bf16 = make_weights(args.experts, args.hidden, args.intermediate, dev, seed=0)
    blk, deq = make_block_fp8_weights(bf16)
    del bf16
    math = ExpertMath("fp8_block", swiglu_limit=10.0)
    wire = combine_wire("bf16")
    for tokens in args.tokens:
        x, pairs = make_routing(tokens, args.experts, args.topk, args.hidden, dev, seed=tokens)
        p = len(pairs)
        flops = 2.0 * p * 3 * args.hidden * args.intermediate
        a = quantize_rows(x, math.a_format, name="probe tokens")
        sel = check_subset(pairs, 256, 0)
        ref = subset_reference(x, pairs, sel, deq, math, exact=False)
        default = default_config(p, args.experts, "block_fp8")
        b: dict = {"tokens": tokens, "pairs": p, "default": str(default), "cases": []}
        rec["buckets"].append(b)
        base = None
        for cand in [None] + CANDIDATES:
            if time.time() - t0 > args.deadline_s:
                b["cases"].append({"config": str(cand), "skipped": "deadline"})
                continue
            cfg = default if cand is None else TileConfig(block_m=cand[0], block_n1=cand[1], block_n2=cand[2], block_k=128,
                                                          num_warps=cand[3], num_stages=cand[4], group_m=cand[5])
            c: dict = {"config": str(cfg), "is_default": cand is None}
            b["cases"].append(c)
            try:
                prov = TritonExperts(capacity=p, config=cfg)
                out = torch.empty(p, wire.row_bytes(args.hidden), dtype=torch.uint8, device=dev)
                fn = lambda prov=prov, out=out: prov.forward_wire(a, pairs, blk, math, wire, out=out)  # noqa: E731
                s = time.time()
                fn()
                torch.cuda.synchronize()
                c["first_call_s"] = round(time.time() - s, 1)
                y = wire.decode_fp32(out, args.hidden)
                c["rel_l2_fp32"] = float(rel_l2(y[sel], ref))
                if base is None:
                    base = out.clone()
                c["bits_equal_default"] = bool(torch.equal(out, base))
                g = capture_graph(fn)
                c["us"] = round(time_fn(g.replay, use_graph=False)[0], 1)
                c["tflops"] = round(flops / c["us"] / 1e6, 1)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit is recorded, not fatal
                c["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                c["trace"] = traceback.format_exc()[-1500:]
            print(json.dumps({k: v for k, v in c.items() if k != "trace"}), flush=True)
            save()
        del x, pairs, a
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
