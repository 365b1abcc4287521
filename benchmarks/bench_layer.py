"""`megamoe bench layer`: the whole MegaMoE layer (ep_size 1) in a CUDA graph, beside its experts
(``--ep N``: the device P2P forward on N rank processes, bench_layer_ep.py).

One GPU. DeepSeek-V4-Pro shapes by default (hidden 7168, intermediate 3072, top-6), local expert
counts 192 (EP2's share) and 48 (EP8's), token buckets of T tokens per rank, uniform random routing,
A8W4 + fp8 dispatch wire and A4W4 + fp4 wire, both combine wires. Per case, all from the same run:

  layer_us            the whole forward (sender quantisation, route kernel, experts, top-k sum),
                      replayed from a CUDA graph, back to back (what a decoding GPU does)
  experts_us          the same layer's experts half alone (``forward_wire`` on the same pairs), graph
  naive_torch_us      argsort + bf16 ``torch._grouped_mm`` on the dequantised weights + index_add
  floor_us            max(weight bytes of the experts hit / HBM, FLOPs / FP8 MMA peak): floor.py with
                      the card's datasheet ceilings, as ``megamoe bench experts``; FP8 because both
                      schemes have MX activations (FP8 MMA on Hopper; floor_peak says so per case).
                      floor_measured_us: the same with this run's measured copy / FP8 GEMM ceilings
                      (meta.ceilings); floor_bf16_us: with the bf16 peak (floor_us before issue 35)
  chain_us_per_layer  a 61-layer chain (RMSNorm + residual between layers, independent routing per
                      layer, one shared weight set: the weights of 61 layers do not fit one GPU and
                      are streamed from HBM either way) captured in ONE graph, replay time / 61
  chain_glue_us_per_layer  the same chain with the MoE layers left out (RMSNorm + residual alone), so
                      chain - glue is what the MoE layer costs inside the chain

  layer_rel_l2        per token against fp32 on the dequantised weights (references.token_reference)
  peers_us            with ``--peers`` (benchmarks/peers.py): each peer's whole MoE call on the same routing and
                      weights, timed the same way; layer_over_peer / experts_over_peer = layer_us /
                      experts_us over it (below 1: the project is faster); the peers' own results,
                      relL2 on the same reference, in the JSON's ``peers``

JSON (``--json``), a table, and a PNG (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from megamoe_backend.experts import ExpertPairs, ExpertWeights
from megamoe_backend.knobs import Knobs
from megamoe_backend.layer.reference import rel_l2
from megamoe_backend.plan import build_plan
from megamoe_backend.spec import preset
from megamoe_backend.transport import clear_transport_cache

from .bench_experts import (
    FLOOR_META,
    card_name,
    case_floors,
    ceiling_ratios,
    environment,
    floor_text,
    graph_or_eager,
    make_weights,
    measure_ceilings,
    slice_weights,
    time_fn,
)
from . import peers as peer_bench
from .floor import datasheet_ceilings, experts_hit
from .gpu_clock import ClockSampler
from .layer_common import CHAIN_LAYERS, COMBINES, EMULATED_SCHEMES, SCHEMES, Routes, bench_knobs, naive_torch_layer, replay_us, rms_norm  # noqa: F401 - re-exported
from .references import check_tokens, token_reference


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, nargs="+", default=[192, 48], help="local experts (ep_size 1 holds them all)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 128, 1024, 8192], help="tokens per rank")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(EMULATED_SCHEMES),
                        help="fp8_block (DeepSeek V3 / R1 FP8 experts) with --emulate only; at ep_size 1: bench experts "
                        "--schemes fp8_block")
    parser.add_argument("--combine-wires", nargs="+", default=list(COMBINES), choices=list(COMBINES))
    parser.add_argument("--mtpr", type=int, default=8192, help="MEGA_MAX_TOKENS_PER_RANK of the layer")
    parser.add_argument("--no-chain", action="store_true", help="skip the 61-layer chain")
    parser.add_argument("--no-baseline", action="store_true", help="skip the naive torch layer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ep", type=int, default=1, help="N > 1: the device P2P forward on N rank processes "
                        "(bench_layer_ep.py; on one GPU a proxy); with --emulate: N ranks in one process")
    parser.add_argument("--emulate", action="store_true", help="per-rank EP figures on one GPU: the N ranks in one process, "
                        "launched in turn (bench_layer_emulated.py); --ep 1 runs EP 8 and EP 2")
    parser.add_argument("--experts-total", type=int, default=384, help="--emulate: experts of the model (local = total / ep)")
    parser.add_argument("--routings", nargs="+", default=["uniform", "zipf", "uneven"],
                        choices=["uniform", "zipf", "uneven"], help="--emulate: routing cases")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--replot", default=None, metavar="JSON", help="only draw --plot from a saved JSON (no GPU)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new case after this many seconds (the JSON lists what did not run)")
    peer_bench.add_arguments(parser)


@dataclass
class LayerCase:
    experts: int
    tokens: int
    scheme: str
    dispatch_wire: str
    combine_wire: str
    ep: int = 1
    provider: str = ""  # the experts provider the layer made ("triton", "humming": MEGA_EXPERTS_GEMM and its rule)
    layer_us: float = float("nan")
    experts_us: float = float("nan")
    naive_torch_us: float = float("nan")
    floor_us: float = float("nan")
    floor_peak: str = ""  # the MMA peak floor_us divides by ("fp8": MX activations)
    floor_bound: str = ""  # "hbm" (weights of the experts hit) or "mma"
    floor_fp8_us: float = float("nan")
    floor_bf16_us: float = float("nan")
    floor_measured_us: float = float("nan")
    mma_floor_us: float = float("nan")
    experts_x_floor: float = float("nan")
    chain_us_per_layer: float = float("nan")
    chain_glue_us_per_layer: float = float("nan")
    chain_moe_us_per_layer: float = float("nan")
    layer_x_experts: float = float("nan")
    layer_minus_experts_us: float = float("nan")
    chain_x_layer: float = float("nan")
    graphed: bool = False
    active_experts: int = 0
    layer_rel_l2: float = float("nan")  # per token vs fp32 on the dequantised weights: what the peers' relL2 reads
    layer_x_floor_measured: float = float("nan")  # layer_us / floor_measured_us
    ratios: dict = field(default_factory=dict)  # layer_* / experts_*: bench_experts.ceiling_ratios (measured copy, FP8 GEMM)
    peers_us: dict = field(default_factory=dict)  # peer -> µs of its whole MoE on this case's routing (same run)
    layer_over_peer: dict = field(default_factory=dict)  # peer -> layer_us / peer µs (below 1: the layer is faster)
    experts_over_peer: dict = field(default_factory=dict)  # peer -> experts_us / peer µs
    clock: dict = field(default_factory=dict)
    error: str = ""


def experts_alone(layer, routes: Routes):
    """The experts half of the forward just run, on the pairs it built: a closure for timing."""
    plan, ws = layer.plan, layer.workspace
    t, n = routes.x.shape[0], routes.x.shape[0] * plan.topk
    pairs = ExpertPairs(ws.pair_row[:n], ws.pair_slot[:n].clone(), ws.pair_weight[:n].clone())
    if plan.dispatch.mx is None:
        rows = routes.x
    else:
        rows = plan.dispatch.decode(ws.token_rows[:t], plan.hidden)  # copies: the layer's buffer is reused
    out = torch.empty_like(ws.combine_rows[:n])
    return lambda: layer.provider.forward_wire(rows, pairs, layer.weights, plan.math, plan.combine, out=out)


def run_case(c: LayerCase, args, weights: ExpertWeights, bf16_weights: ExpertWeights, device,
             ceilings: dict | None = None) -> LayerCase:
    from megamoe_backend.layer import MegaMoELayer

    spec = preset("dsv4-pro").scaled(n_routed_experts=c.experts)
    knobs = bench_knobs(dispatch_wire=c.dispatch_wire, combine_wire=c.combine_wire, max_tokens_per_rank=args.mtpr)
    plan = build_plan(spec, knobs, quant=c.scheme, device_type="cuda")
    layer = MegaMoELayer(plan, weights, device=device)
    if layer.workspace is None:
        raise RuntimeError(f"the layer did not take the device forward (provider {plan.backends.provider})")
    c.provider = layer.provider.name
    routes = Routes(c.tokens, c.experts, plan.topk, plan.hidden, device, args.seed)
    c.active_experts = experts_hit(routes.ids)
    for key, value in case_floors(ceilings, experts_hit=c.active_experts, pairs=c.tokens * plan.topk,
                                  hidden=plan.hidden, intermediate=spec.moe_intermediate_size, weight_fmt="mxfp4",
                                  a_fmt=plan.math.a_format).items():
        setattr(c, key, value)

    tokens = check_tokens(c.tokens, peer_bench.CHECK_TOKENS, args.seed, device)
    y = layer(routes.x, routes.ids, routes.w)
    c.layer_rel_l2 = rel_l2(y[tokens].float(), token_reference(routes.x, routes.ids, routes.w, bf16_weights,
                                                                spec.swiglu_limit, tokens))
    del y
    layer_call, c.graphed = graph_or_eager(lambda: layer(routes.x, routes.ids, routes.w))
    with ClockSampler(device) as clock:
        c.layer_us, _ = time_fn(layer_call, use_graph=False)
    c.clock = clock.stats()
    experts_call, _ = graph_or_eager(experts_alone(layer, routes))
    c.experts_us, _ = time_fn(experts_call, use_graph=False)
    if not args.no_baseline:
        naive_call, _ = graph_or_eager(lambda: naive_torch_layer(routes.x, routes.ids, routes.w, bf16_weights,
                                                                 spec.swiglu_limit))
        c.naive_torch_us, _ = time_fn(naive_call, use_graph=False)
    if not args.no_chain:
        c.chain_us_per_layer = chain_us(layer, c, args, device)
        c.chain_glue_us_per_layer = chain_us(layer, c, args, device, glue_only=True)
    c.layer_x_experts = c.layer_us / c.experts_us
    c.experts_x_floor = c.experts_us / c.floor_us
    c.layer_minus_experts_us = c.layer_us - c.experts_us
    c.chain_moe_us_per_layer = c.chain_us_per_layer - c.chain_glue_us_per_layer
    c.chain_x_layer = c.chain_moe_us_per_layer / c.layer_us
    c.layer_x_floor_measured = c.layer_us / c.floor_measured_us
    shape = dict(experts_hit=c.active_experts, pairs=c.tokens * plan.topk, hidden=plan.hidden,
                 intermediate=spec.moe_intermediate_size)
    for what, us in (("layer", c.layer_us), ("experts", c.experts_us)):
        c.ratios.update({f"{what}_{k}": v for k, v in ceiling_ratios(us, ceilings, **shape).items()})
    return c


def run_peers_for(n_exp: int, tokens: int, ready: list, fp4: ExpertWeights, bf16: ExpertWeights, args, device,
                  ceilings: dict, cases: list[LayerCase]) -> list:
    """The peers on the routing every case of (n_exp, tokens) ran (Routes with the same seed), each case
    then holding their µs and its ratios to them (peers_us, layer_over_peer, experts_over_peer)."""
    spec = preset("dsv4-pro")
    hidden, inter, topk = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts_per_tok
    routes = Routes(tokens, n_exp, topk, hidden, device, args.seed)
    sample = check_tokens(tokens, peer_bench.CHECK_TOKENS, args.seed, device)
    ref = token_reference(routes.x, routes.ids, routes.w, bf16, spec.swiglu_limit, sample)
    shape = peer_bench.PeerShape(hidden, inter, topk, spec.swiglu_limit)
    results = peer_bench.run_peers(ready, fp4, shape, routes.x, routes.ids, routes.w,
                                   lambda y: rel_l2(y[sample].float(), ref), max_tokens=max(args.tokens))
    active = experts_hit(routes.ids)
    for r in results:
        if not r.usable():
            continue
        r.ratios.update(ceiling_ratios(r.us, ceilings, experts_hit=active, pairs=r.pairs, hidden=hidden, intermediate=inter))
        for c in cases:
            if (c.experts, c.tokens) == (n_exp, tokens) and not c.error:
                c.peers_us[r.peer] = r.us
                c.layer_over_peer[r.peer] = c.layer_us / r.us
                c.experts_over_peer[r.peer] = c.experts_us / r.us
    return results


def chain_us(first, c: LayerCase, args, device, glue_only: bool = False) -> float:
    """µs per layer of the 61-layer chain in one graph (``glue_only``: RMSNorm + residual, no MoE)."""
    from megamoe_backend.layer import MegaMoELayer

    layers = [first] + [MegaMoELayer(first.plan, first.weights, device=device, layer_id=i) for i in range(1, CHAIN_LAYERS)]
    routes = [Routes(c.tokens, c.experts, first.plan.topk, first.plan.hidden, device, args.seed + 1 + i)
              for i in range(CHAIN_LAYERS)]
    x0 = routes[0].x.clone()

    def chain():
        h = x0
        for layer, r in zip(layers, routes):
            n = rms_norm(h)
            h = h + (r.x if glue_only else layer(n, r.ids, r.w))
        return h

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    us = replay_us(graph) / CHAIN_LAYERS
    del graph
    return us


def run(args: argparse.Namespace) -> int:
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        target = args.plot or args.replot.replace(".json", ".png")
        if saved["cases"] and "routing" in saved["cases"][0]:  # an --emulate run
            from .bench_layer_emulated import EmulatedCase, plot_emulated

            plot_emulated([EmulatedCase(**c) for c in saved["cases"]], target, card_name(saved["meta"]))
        elif saved["cases"] and "experts_per_rank" in saved["cases"][0]:  # a --ep N run
            from .bench_layer_ep import EPLayerCase, plot_ep

            plot_ep([EPLayerCase(**c) for c in saved["cases"]], target, saved["meta"].get("placement", ""))
        else:
            plot([LayerCase(**c) for c in saved["cases"]], target, card_name(saved["meta"]))
        return 0
    if not args.emulate and set(args.schemes) - set(SCHEMES):
        print(f"--schemes {' '.join(sorted(set(args.schemes) - set(SCHEMES)))} runs with --emulate; at ep_size 1 "
              "`megamoe bench experts --schemes fp8_block` times the block-FP8 experts", file=sys.stderr)
        return 2
    if args.peers is not None and args.ep > 1 and not args.emulate:
        print("--peers runs with ep_size 1 and --emulate (one process); not with --ep N rank processes", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench layer needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.emulate:
        from .bench_layer_emulated import run_emulated

        return run_emulated(args)
    if args.ep > 1:
        from .bench_layer_ep import run_ep

        return run_ep(args)
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = environment(argparse.Namespace(**{**vars(args), "hidden": 7168, "intermediate": 3072, "topk": 6}), __name__)
    meta["what"] = "megamoe bench layer: MegaMoELayer device forward, ep_size 1, one GPU"
    meta["ceilings"] = {**datasheet_ceilings(device), **measure_ceilings(device)}
    meta["floor"] = FLOOR_META
    meta["experts_gemm"] = Knobs.from_env().experts_gemm  # MEGA_EXPERTS_GEMM asked; each case's provider: who ran
    spec = preset("dsv4-pro")
    fp4_all, bf16_all = make_weights(max(args.experts), spec.hidden_size, spec.moe_intermediate_size, device, args.seed)
    cases: list[LayerCase] = []
    peer_results: list = []
    ready_peers = []
    if args.peers is not None:
        ready_peers, skipped = peer_bench.select(args.peers, args.peer_tune_cache)
        meta["peers"] = peer_bench.describe(ready_peers, skipped)
    meta["not_run"] = []  # cases left out by --budget-s
    t0 = time.time()

    def spent(what: dict) -> bool:
        if args.budget_s is None or time.time() - t0 <= args.budget_s:
            return False
        meta["not_run"].append(what)
        print(f"  --budget-s {args.budget_s:.0f} spent: {what} not run", file=sys.stderr)
        return True

    for n_exp in args.experts:  # in the order given (the default is 192 then 48)
        fp4, bf16 = slice_weights(fp4_all, n_exp), slice_weights(bf16_all, n_exp)
        for scheme in args.schemes:
            for combine in args.combine_wires:
                for tokens in args.tokens:
                    if spent({"experts": n_exp, "tokens": tokens, "scheme": scheme, "combine_wire": combine}):
                        continue
                    c = LayerCase(n_exp, tokens, scheme, SCHEMES[scheme], combine)
                    try:
                        run_case(c, args, fp4, bf16, device, meta["ceilings"])
                    except Exception as exc:  # noqa: BLE001 - one failing case must not sink the sweep
                        c.error = f"{type(exc).__name__}: {str(exc)[:400]}"
                    clear_transport_cache()  # the next case has other wires: drop this one's workspace
                    torch.cuda.empty_cache()
                    cases.append(c)
                    print(line(c), flush=True)
                    save(args.json, meta, cases, time.time() - t0, peer_results)
        for tokens in args.tokens if ready_peers else ():
            if not spent({"experts": n_exp, "tokens": tokens, "peers": [p.name for p in ready_peers]}):
                peer_results += run_peers_for(n_exp, tokens, ready_peers, fp4, bf16, args, device, meta["ceilings"], cases)
                save(args.json, meta, cases, time.time() - t0, peer_results)
    meta["complete"] = not meta["not_run"]
    save(args.json, meta, cases, time.time() - t0, peer_results)
    print_table(cases)
    if args.plot:
        plot(cases, args.plot, card_name(meta))
    return 0


def line(c: LayerCase) -> str:
    return (f"E{c.experts:<4d} T{c.tokens:<5d} {c.scheme} {c.dispatch_wire}/{c.combine_wire:18s} layer {c.layer_us:9.1f} "
            f"experts {c.experts_us:9.1f} (x{c.layer_x_experts:.3f}, +{c.layer_minus_experts_us:.1f}) naive "
            f"{c.naive_torch_us:9.1f} floor {floor_text(c)} (experts x{c.experts_x_floor:.2f}) chain/layer {c.chain_us_per_layer:9.1f} "
            f"- glue {c.chain_glue_us_per_layer:.1f} (x{c.chain_x_layer:.3f}) {'graph' if c.graphed else 'EAGER'} {c.error[:120]}")


def save(path, meta, cases, seconds, peers: list | None = None) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": {**meta, "seconds": round(seconds, 1)}, "cases": [asdict(c) for c in cases],
                   "peers": [asdict(r) for r in peers or []]}, f, indent=1, default=str)


def print_table(cases: list[LayerCase]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="MegaMoE layer, ep_size 1, one GPU (µs)")
    for col in ("E", "T", "scheme", "combine", "layer", "experts", "x", "naive torch", "floor", "experts x floor",
                "chain/layer", "glue", "x", "relL2", "best peer µs", "layer / peer"):
        t.add_column(col, justify="right")
    for c in cases:
        best = min(c.peers_us, key=c.peers_us.get) if c.peers_us else None
        t.add_row(str(c.experts), str(c.tokens), c.scheme, c.combine_wire[:4], f"{c.layer_us:.1f}", f"{c.experts_us:.1f}",
                  f"{c.layer_x_experts:.3f}", f"{c.naive_torch_us:.1f}",
                  floor_text(c), f"{c.experts_x_floor:.2f}",
                  f"{c.chain_us_per_layer:.1f}",
                  f"{c.chain_glue_us_per_layer:.1f}", f"{c.chain_x_layer:.3f}", f"{c.layer_rel_l2:.4f}",
                  f"{c.peers_us[best]:.1f} {best}" if best else "-", f"{c.layer_us / c.peers_us[best]:.3f}" if best else "-")
    Console(width=200).print(t)


def plot(cases: list[LayerCase], path: str, card: str) -> None:
    """One panel per (experts, scheme, combine wire): a row per expert count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [c for c in cases if not c.error]
    peak = ok[0].floor_peak if ok and ok[0].floor_peak else "bf16"  # JSONs before issue 35 have no floor_peak: bf16
    rows = sorted({c.experts for c in ok}, reverse=True)
    cols = sorted({(c.scheme, c.combine_wire) for c in ok}, reverse=True)
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(3.6 * len(cols), 3.2 * len(rows)), squeeze=False)
    for i, e in enumerate(rows):
        for j, (scheme, combine) in enumerate(cols):
            ax = axes[i][j]
            pts = sorted((c for c in ok if (c.experts, c.scheme, c.combine_wire) == (e, scheme, combine)), key=lambda c: c.tokens)
            tok = [c.tokens for c in pts]
            for attr, style, label in (("layer_us", "o-", "layer (graph)"), ("experts_us", "s--", "experts alone"),
                                       ("chain_moe_us_per_layer", "^:", "in a 61-layer graph"),
                                       ("naive_torch_us", "x-", "naive torch"),
                                       ("floor_us", "k--", f"floor (HBM / {peak} MMA)")):
                ax.plot(tok, [getattr(c, attr) for c in pts], style, label=label, markersize=4)
            for name in sorted({n for c in pts for n in c.peers_us}):  # the peers on the same routing (--peers)
                ax.plot(tok, [c.peers_us.get(name, float("nan")) for c in pts], "v-.", label=f"{name} (peer)", markersize=4)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{e} experts, {scheme}, combine {'fp8' if combine != 'bf16' else 'bf16'}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(rows) - 1:
                ax.set_xlabel("tokens per rank")
            if j == 0:
                ax.set_ylabel("µs per layer")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"MegaMoE layer on one {card} (ep_size 1, DSV4-Pro shapes): megamoe bench layer", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megamoe bench layer", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
