"""Per-kernel CUDA time of one TritonExperts forward (torch.profiler), for tile / decoder studies.

Why beside `megamoe bench experts`: the bench times the whole forward (what users get); this splits
it into GEMM1 / GEMM2 / gather / layout so a change can be attributed. `--variant nodecode` swaps
the frag decoder's PTX for plain moves (frag only) (same loads, registers and MMAs; wrong numbers on purpose):
the time that remains is what the decode does not cost.

    PYTHONPATH=. python3 benchmarks/research/profile_experts.py --tokens 8 128 --config 16,128,128,128,4,3 \\
        --json $OUT/profile.json
    # interleaved A/B of decoders: each decoder's bucket default plus extra frag8 tiles
    PYTHONPATH=. python3 benchmarks/research/profile_experts.py --decoder frag frag8 --config frag8:16,256,256,64,4,4 --rounds 3
    # the same A/B timed as the bench times (sustained graph replays, SM clock recorded), no kernel split
    PYTHONPATH=. python3 benchmarks/research/profile_experts.py --decoder frag8 --tokens 1024 --config 64,256,256,128,4,3,4,32 --rounds 3 --sustained
    # ... or as single graph replays after a GPU sleep: the whole forward at full clock (gaps included)
    PYTHONPATH=. python3 benchmarks/research/profile_experts.py --decoder frag8 --tokens 1024 --config 64,256,256,128,4,3,4,32 --isolated
    # what GEMM2 writes: fp32 rows, fp32 rows + the layer's old torch encode to a combine wire, or the wire row itself
    PYTHONPATH=. python3 benchmarks/research/profile_experts.py --decoder frag8 --tokens 1024 8192 \\
        --out f32 f32+bf16 bf16 f32+fp8_blockwise_1x32 fp8_blockwise_1x32
    # timing proxy: beside the bench's routing, the same with the pairs of every expert holding 33-48 of them
    # cut to its first 32 (those experts then run in 32-row tiles: what half the MMA width would buy them;
    # the cut pairs' rows are not computed, so not a result the provider gives)
    PYTHONPATH=. python3 benchmarks/research/profile_experts.py --decoder frag8 --tokens 1024 --trim 33:48:32 --out bf16 --rounds 3

Kernel sums time a few forwards after the GPU idled, at full clock; under sustained load the H200
here runs power-capped and ~10 % slower (docs/triton.md), and a tile can win one way and tie the
other. ``--sustained`` times each config like `megamoe bench experts` (median of back-to-back
CUDA-graph replays) with NVML's clock / power-cap state beside it (benchmarks/gpu_clock.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=192)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 128, 1024])
    ap.add_argument("--config", action="append", default=[],
                    help="[decoder:]block_m,block_n1,block_n2,block_k,num_warps,num_stages[,group_m[,tail_m[,max_registers[,tail_ride[,tail_max_registers]]]]] (repeatable; without a "
                         "decoder prefix it applies to every decoder; each decoder also runs its bucket default)")
    ap.add_argument("--variant", choices=["base", "nodecode"], default="base")
    ap.add_argument("--decoder", choices=["frag", "frag8"], nargs="+", default=["frag"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the configs interleaved this many times (A/B against drift in clocks / power)")
    timing = ap.add_mutually_exclusive_group()
    timing.add_argument("--sustained", action="store_true",
                        help="time each config as the bench does (graph replays back to back) instead of profiler kernel sums")
    timing.add_argument("--isolated", action="store_true",
                        help="time single graph replays after a GPU sleep (the whole forward at full clock, gaps between kernels included)")
    ap.add_argument("--out", nargs="+", default=["f32"],
                    choices=["f32", "f32+bf16", "f32+fp8_blockwise_1x32", "bf16", "fp8_blockwise_1x32"],
                    help="what a forward returns: fp32 rows (forward), fp32 rows then WireFormat.encode to that combine "
                         "wire in torch (f32+WIRE: the layer before forward_wire), or the combine wire written by GEMM2 (forward_wire)")
    ap.add_argument("--trim", default="",
                    help="LO:HI:KEEP: also time each token count with the pairs of every expert holding LO..HI of them "
                         "cut to its first KEEP (a timing proxy for narrower tiles; the cut rows are not computed)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    trim = None
    if args.trim:
        try:
            trim = tuple(int(v) for v in args.trim.split(":"))
        except ValueError:
            trim = ()
        if len(trim) != 3 or not 0 < trim[2] < trim[0] <= trim[1]:
            ap.error(f"--trim {args.trim!r}: want LO:HI:KEEP with 0 < KEEP < LO <= HI (e.g. 33:48:32)")
    if not torch.cuda.is_available():
        print("profile_experts needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton.language as tl

    from megamoe_backend.experts.triton import mxjit

    if args.variant == "nodecode":  # must precede the first compile of the kernels
        mxjit._FRAG_ASM = tl.constexpr("{\nmov.b32 $0, $4;\nmov.b32 $1, $5;\nmov.b32 $2, $7;\nmov.b32 $3, $4;\n}")
        mxjit._FRAG8_ASM = tl.constexpr("{\nmov.b32 $0, $2;\nmov.b32 $1, $3;\n}")  # frag8: word and row g's table
    from benchmarks.bench_experts import capture_graph, forward_call, make_routing, make_weights, time_fn, time_isolated
    from benchmarks.gpu_clock import ClockSampler
    from megamoe_backend.experts import ExpertMath
    from megamoe_backend.experts.triton.config import TileConfig
    from megamoe_backend.experts.triton.provider import TritonExperts
    from megamoe_backend.experts.triton.quant import quantize_rows
    from megamoe_backend.formats.wire import combine_wire

    dev = torch.device("cuda")
    fp4, bf16 = make_weights(args.experts, 7168, 3072, dev, 0)
    del bf16
    math = ExpertMath("a8w4", 10.0)
    prepared = {d: TritonExperts(decoder=d).prepare_weights(fp4, math) for d in args.decoder}
    del fp4
    runs = []  # (decoder, config or None = the bucket default, output)
    for d in args.decoder:
        cfgs = [None]
        for c in args.config:
            dec, _, spec = c.rpartition(":")
            if dec in ("", d):
                cfgs.append(TileConfig(*map(int, spec.split(","))))
        runs += [(d, cfg, o) for cfg in cfgs for o in args.out]

    def forward_of(prov, dec, out, a, pairs):
        """One forward returning what ``out`` names (--out): the bench's call, or fp32 rows + torch encode."""
        w = prepared[dec]
        if out.startswith("f32+"):
            wire = combine_wire(out[4:])
            return lambda: wire.encode(prov.forward(a, pairs, w, math))
        return forward_call(prov, a, pairs, w, math, "fp32" if out == "f32" else out)

    rows = []
    for tokens in args.tokens:
        x, full = make_routing(tokens, args.experts, 6, 7168, dev, tokens)
        a = quantize_rows(x, "fp8")
        routings = [("all", full)]
        if trim:
            routings.append((f"trim {args.trim}", trim_pairs(full, args.experts, *trim)))
        cases = [(r, run) for r in routings for run in runs]
        calls = [forward_of(TritonExperts(capacity=len(p), decoder=d, config=cfg), d, o, a, p) for (_, p), (d, cfg, o) in cases]
        for call in calls:
            for _ in range(3):
                call()
        torch.cuda.synchronize()
        for rnd in range(args.rounds):
            for ((routing, pairs), (dec, cfg, out)), call in zip(cases, calls):
                row = {"variant": args.variant, "decoder": dec, "experts": args.experts, "tokens": tokens, "out": out,
                       "round": rnd, "config": None if cfg is None else list(vars(cfg).values())}
                if args.trim:
                    row.update(routing=routing, pairs=len(pairs))
                if args.sustained or args.isolated:
                    with ClockSampler(dev) as clock:
                        if args.sustained:
                            us, graphed = time_fn(call, use_graph=True)
                        else:
                            row["isolated_us"] = time_isolated(capture_graph(call).replay)
                            us, graphed = statistics.median(row["isolated_us"]), True
                    row.update(graph_us=round(us, 1), graph=graphed, clock=clock.stats())
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    continue
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.iters):
                        call()
                    torch.cuda.synchronize()
                kernels = [(ev.name.split("(")[0][:48], ev.device_time) for ev in prof.events()
                           if ev.device_type == torch.autograd.DeviceType.CUDA]
                per_kernel = collections.defaultdict(float)
                for name, t in kernels:
                    per_kernel[name] += t / args.iters
                row.update(total_us=round(sum(per_kernel.values()), 1),
                           kernels_us={k: round(v, 1) for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])},
                           launches_us=per_launch(kernels, args.iters))
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def trim_pairs(pairs, n_exp: int, lo: int, hi: int, keep: int):
    """The routing with, for every expert holding lo..hi pairs, only its first ``keep`` pairs (in
    pair order). A timing proxy: those experts' tiles then run at the height of ``keep`` rows."""
    from megamoe_backend.experts import ExpertPairs

    counts = torch.bincount(pairs.slot, minlength=n_exp)
    order = torch.argsort(pairs.slot, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device) - (torch.cumsum(counts, 0) - counts)[pairs.slot[order]]
    n = counts[pairs.slot]
    kept = ~((n >= lo) & (n <= hi) & (rank >= keep))
    return ExpertPairs(pairs.row[kept], pairs.slot[kept].contiguous(), pairs.weight[kept].contiguous())


def per_launch(kernels: list[tuple[str, float]], iters: int) -> dict[str, float]:
    """Median time of each launch of one forward, keyed name#n (the n-th launch of that kernel in
    the forward): a GEMM's tile passes (full / ride / short) share one kernel name, so only their
    order tells them apart. Empty when the events do not split into iters equal forwards."""
    if not kernels or len(kernels) % iters:
        return {}
    n = len(kernels) // iters
    forwards = [kernels[i * n:(i + 1) * n] for i in range(iters)]
    if any([k for k, _ in f] != [k for k, _ in forwards[0]] for f in forwards):
        return {}
    seen: collections.Counter = collections.Counter()
    out = {}
    for pos, (name, _) in enumerate(forwards[0]):
        out[f"{name}#{seen[name]}"] = round(statistics.median(f[pos][1] for f in forwards), 1)
        seen[name] += 1
    return out


if __name__ == "__main__":
    sys.exit(main())
