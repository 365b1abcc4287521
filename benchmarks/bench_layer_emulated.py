"""`megamoe bench layer --ep N --emulate`: one EP rank's device P2P forward, per rank, on ONE GPU.

The N ranks of one layer run in one process (benchmarks/emulated_ep.py): the ranks' arenas are one
allocation, each rank's steps are launched in turn on one stream, so nothing time-slices the GPU and
every figure is one rank's own kernels. A step is timed with the GPU held busy (torch.cuda._sleep)
while the host enqueues it, so CUDA events around each rank's launches see no host gaps. Per case:

  rank_us          the slowest rank's whole forward: dispatch, both barriers (signal + wait), the
                   experts half, top-k sum (kernels only, median of the timed steps)
  experts_us       that rank's experts half alone (layout, A rescale, GEMM1, A2 rescale, GEMM2 into
                   the sources' combine regions)
  rank_us_by_rank  every rank's
  steps_us         the slowest rank's µs per step (dispatch, barrier signals / waits, experts, top-k sum)
  step_graph_us    the whole emulated step (all ranks, in turn) replayed from ONE CUDA graph / N: also
                   shows the step is capturable
  nvlink_model_us  a MODEL, not a measurement: the slowest rank's dispatch + combine bytes to other
                   ranks / NVLINK_BYTES_PER_S per direction + BARRIER_LATENCY_US per barrier; in the
                   emulator those bytes go to the same GPU's HBM (inside rank_us)
  naive_torch_us   one rank's share in naive torch: the pairs routed to rank 0, argsort + bf16
                   torch._grouped_mm of its local experts + index_add (graph replay)
  floor_us         the slowest rank's floor (benchmarks/floor.py: its experts hit / HBM, its FLOPs / FP8 peak)
  weight_stream_us the busiest rank's weights (its experts hit) streamed at the copy rate measured at
                   the start of the run (meta.ceilings); rank_x_weight_stream = rank_us / it (issue 48)
  floor_measured_us the slowest rank's floor at the run's measured copy / FP8 GEMM ceilings
  peers_us         with --peers: each peer on the slowest rank's share (its local experts, the tokens that
                   reach it, their global top-k ids; benchmarks/peers.py), the same routing; rank_over_peer /
                   experts_over_peer = rank_us / experts_us over it (below 1: the project is faster)

Cases: EP x local experts x tokens per rank x scheme x combine wire x bound (max_tokens_across_ranks
passed or not) x routing ("uniform", "zipf": expert popularity ~ 1 / rank^ZIPF_S, hot experts spread
over ranks at random; "uneven": uniform routing, DP batches 0, T/2, T by rank).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

NVLINK_BYTES_PER_S = 450e9  # H200 NVLink 4: 900 GB/s bidirectional per GPU, 450 GB/s each way
BARRIER_LATENCY_US = 3.0  # assumed: one system-scope flag store + poll across NVLink, both directions
ZIPF_S = 1.0
TIMED_STEPS = 5
# The spans EmulatedEP.forward times per rank, in order: each next() of P2PForward.steps (the one that hands over a
# barrier launches nothing) and each barrier's signal and wait launches. timed_steps refuses a forward whose span
# count differs, so a change of the generator cannot shift the names onto other spans (it once labelled
# "wait 0" as the experts).
STEPS = ("dispatch", "barrier 0 handed", "signal 0", "wait 0", "experts", "barrier 1 handed", "signal 1", "wait 1",
         "top-k sum")
ROUTINGS = ("uniform", "zipf", "uneven")


@dataclass
class EmulatedCase:
    ep: int
    experts: int  # local experts per rank
    tokens: int  # per rank (the largest rank's under "uneven")
    scheme: str
    dispatch_wire: str
    combine_wire: str
    routing: str
    bounded: bool
    rank_us: float = float("nan")
    experts_us: float = float("nan")
    rank_us_by_rank: list = field(default_factory=list)
    experts_us_by_rank: list = field(default_factory=list)
    steps_us: dict = field(default_factory=dict)  # the slowest rank's µs per step (STEPS)
    step_graph_us: float = float("nan")
    nvlink_model_us: float = float("nan")
    naive_torch_us: float = float("nan")
    floor_us: float = float("nan")
    floor_bound: str = ""
    live_pairs_by_rank: list = field(default_factory=list)
    tokens_by_rank: list = field(default_factory=list)
    experts_hit_by_rank: list = field(default_factory=list)
    weight_stream_us: float = float("nan")
    rank_x_weight_stream: float = float("nan")
    floor_measured_us: float = float("nan")
    rank_x_floor_measured: float = float("nan")
    peer_rank: int = -1  # the rank whose share the peers ran (the slowest of the first case of these routes)
    peers_us: dict = field(default_factory=dict)
    rank_over_peer: dict = field(default_factory=dict)
    experts_over_peer: dict = field(default_factory=dict)
    peers_error: str = ""  # a failure around the peers (never the project's case: ``error`` is its own)
    error: str = ""


def rank_tokens(routing: str, tokens: int, ep: int) -> list[int]:
    """Tokens each rank brings: T everywhere, or (uneven) 0, T/2, T, 0, T/2, ... by rank."""
    if routing != "uneven":
        return [tokens] * ep
    return [(0, tokens // 2, tokens)[r % 3] for r in range(ep)]


def make_routes(routing: str, tokens: list[int], n_exp: int, topk: int, hidden: int, device, seed: int):
    """Per rank (x, global ids, weights); zipf: Gumbel top-k over log popularity (no repeats per token)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if routing == "zipf":
        pop = 1.0 / torch.arange(1, n_exp + 1, device=device, dtype=torch.float32) ** ZIPF_S
        logp = pop.log()[torch.randperm(n_exp, generator=g, device=device)]
    else:
        logp = torch.zeros(n_exp, device=device)
    routes = []
    for t in tokens:
        x = torch.randn(t, hidden, generator=g, device=device).to(torch.bfloat16)
        gumbel = -torch.log(-torch.log(torch.rand(t, n_exp, generator=g, device=device).clamp_min(1e-20)))
        ids = (logp[None, :] + gumbel).topk(topk, dim=1).indices
        w = torch.rand(t, topk, generator=g, device=device)
        routes.append((x, ids, w / w.sum(1, keepdim=True)))
    return routes


def nvlink_model_us(routes, ep: int, experts: int, row_bytes: int, comb_bytes: int, topk: int) -> float:
    """The slowest rank's modelled NVLink time (module docstring): rows and (slot, weight) entries it
    sends in dispatch, combine rows its experts send back, to ranks other than itself."""
    worst = 0.0
    out_bytes = [0] * ep
    for src, (_, ids, _) in enumerate(routes):
        owner = ids // experts  # [t, k]
        for r in range(ep):
            if r == src:
                continue
            hits = owner == r
            out_bytes[src] += int(hits.any(dim=1).sum()) * row_bytes + ids.shape[0] * topk * 12
            out_bytes[r] += int(hits.sum()) * comb_bytes  # rank r's experts return these rows to src
    for b in out_bytes:
        worst = max(worst, b / NVLINK_BYTES_PER_S * 1e6)
    return worst + 2 * BARRIER_LATENCY_US


def rank_share(routes, rank: int, experts: int):
    """(x rows, local ids [P], route weights [P], pair rows [P]) of the pairs routed to ``rank``."""
    xs, ids, ws = (torch.cat([r[i] for r in routes]) for i in range(3))
    here = (ids // experts) == rank
    tok, j = here.nonzero(as_tuple=True)
    return xs, (ids[tok, j] - rank * experts), ws[tok, j].float(), tok


def rank_token_share(routes, rank: int, experts: int):
    """(x rows, global ids [U, k], route weights [U, k]) of the U tokens (of all ranks) with at least one
    pair on ``rank``: what a fused MoE that takes EP ranks natively runs there (benchmarks/peers.py)."""
    xs, ids, ws = (torch.cat([r[i] for r in routes]) for i in range(3))
    tok = ((ids // experts) == rank).any(dim=1).nonzero().squeeze(1)
    return xs[tok], ids[tok], ws[tok]


def run_rank_peers(ready, routes, rank: int, ep: int, experts: int, weights, spec, args, ceilings: dict) -> list:
    """The peers on ``rank``'s share (rank_token_share), relL2 per token against the fp32 reference of
    its local pairs (references.token_reference on the rank's dequantised experts)."""
    from megamoe_backend.layer.reference import rel_l2

    from .bench_experts import ceiling_ratios
    from .peers import CHECK_TOKENS, PeerShape, run_peers
    from .references import check_tokens, token_reference

    x, ids, w = rank_token_share(routes, rank, experts)
    if not x.shape[0]:
        return []
    here = (ids // experts) == rank
    local = torch.where(here, ids - rank * experts, -1)
    sample = check_tokens(x.shape[0], CHECK_TOKENS, args.seed, x.device)
    ref = token_reference(x, local, w, weights[rank], spec.swiglu_limit, sample)
    shape = PeerShape(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts_per_tok, spec.swiglu_limit)
    results = run_peers(ready, weights[rank], shape, x, ids, w, lambda y: rel_l2(y[sample].float(), ref),
                        max_tokens=x.shape[0], ep_size=ep, ep_rank=rank)
    hit = int(torch.unique(local[here]).numel())
    for r in results:
        if r.usable():
            r.ratios.update(ceiling_ratios(r.us, ceilings, experts_hit=hit, pairs=r.pairs, hidden=spec.hidden_size,
                                           intermediate=spec.moe_intermediate_size))
    return results


def timed_steps(emu, inputs, bound, n: int = TIMED_STEPS):
    """Per-rank (whole µs, per-step µs) of ``n`` forwards (medians), the GPU held busy while each is enqueued."""
    from .emulated_ep import RankTimer

    emu.forward(inputs, bound)  # warm: compiles, allocator
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    emu.forward(inputs, bound)
    enqueue_s = time.perf_counter() - t0  # host time to enqueue one step (the GPU kept up: upper bound)
    torch.cuda.synchronize()
    whole, steps = [], []
    for _ in range(n):
        timer = RankTimer(emu.ep)
        torch.cuda._sleep(int(max(2e6, enqueue_s * 2.5 * 1.9e9)))  # ~1.9 GHz: cycles that outlast the enqueue
        emu.forward(inputs, bound, timer=timer)
        torch.cuda.synchronize()
        spans = [[b.elapsed_time(e) * 1e3 for b, e in s] for s in timer.spans]
        if any(len(s) != len(STEPS) for s in spans):
            raise RuntimeError(f"emulated forward timed {[len(s) for s in spans]} spans per rank, STEPS names "
                               f"{len(STEPS)}: P2PForward.steps changed, update STEPS")
        whole.append([sum(s) for s in spans])
        steps.append(spans)
    per_rank = [statistics.median(v) for v in zip(*whole)]
    per_step = [[statistics.median(run[r][i] for run in steps) for i in range(len(STEPS))] for r in range(emu.ep)]
    return per_rank, per_step


def step_graph_us(emu, inputs, bound) -> float:
    from .bench_experts import capture_graph

    g = capture_graph(lambda: emu.forward(inputs, bound))
    for _ in range(2):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / 5 / emu.ep


def run_group(ep: int, experts: int, args, cases: list[EmulatedCase], meta: dict, save, ready_peers=(),
              peer_results=None, t0: float = 0.0) -> None:
    """Every case of one (EP, local experts): rank weights made once, one emulated EP per wire set."""
    from megamoe_backend.plan import build_plan
    from megamoe_backend.spec import preset
    from megamoe_backend.transport import clear_transport_cache

    from .bench_experts import graph_or_eager, make_block_fp8_weights, make_weights, measured_peaks, time_fn
    from .emulated_ep import EmulatedEP
    from .floor import datasheet_of, expert_floor, weight_bytes_per_expert
    from .layer_common import EMULATED_SCHEMES, WEIGHT_FMT_OF, bench_knobs, naive_torch_layer

    device = torch.device("cuda")
    spec = preset("dsv4-pro").scaled(n_routed_experts=ep * experts)
    hidden, inter, topk = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts_per_tok
    sheet = datasheet_of(meta.get("ceilings"))
    rank_weights = {WEIGHT_FMT_OF[s]: [] for s in args.schemes}  # weight format -> every rank's experts
    bf16_rank0 = None  # naive torch's weights (bf16 _grouped_mm, timing only); not held with --no-baseline (6.3 GB at
    # DSV4-Pro shapes, room on a smaller GPU)
    for r in range(ep):
        fp4, bf16 = make_weights(experts, hidden, inter, device, args.seed + r)
        if "mxfp4" in rank_weights:
            rank_weights["mxfp4"].append(fp4)
        if "fp8_block" in rank_weights:  # the same values block-quantised, as DeepSeek V3 / R1 FP8 checkpoints hold them
            rank_weights["fp8_block"].append(make_block_fp8_weights(bf16, dequantised=False)[0])
        bf16_rank0 = bf16 if r == 0 and not args.no_baseline else bf16_rank0
        del fp4, bf16
    for scheme in args.schemes:
        weight_fmt = WEIGHT_FMT_OF[scheme]
        weights = rank_weights[weight_fmt]
        for combine in args.combine_wires:
            knobs = bench_knobs(dispatch_wire=EMULATED_SCHEMES[scheme], combine_wire=combine,
                                max_tokens_per_rank=args.mtpr, transport="ipc")
            plans = [build_plan(spec, knobs, r, ep, quant=scheme, backends=("triton", "ipc")) for r in range(ep)]
            emu = EmulatedEP(ep, plans.__getitem__, weights.__getitem__, device, share_scratch=True)
            meta["experts_scratch"] = "one set, shared by the emulated ranks (their experts steps run in turn)"
            meta.setdefault("experts_provider", {})[f"ep{ep}"] = emu.layers[0].provider.name  # who ran the GEMMs
            ws0 = emu.layers[0].workspace
            for routing in args.routings:
                if routing != "uniform" and (scheme, combine) != (args.schemes[0], args.combine_wires[0]):
                    continue  # skewed / uneven cases on the first scheme and wire only
                for tokens in args.tokens:
                    toks = rank_tokens(routing, tokens, ep)
                    routes = make_routes(routing, toks, ep * experts, topk, hidden, device, args.seed + tokens)
                    for bounded in (True, False):
                        if args.budget_s is not None and time.time() - t0 > args.budget_s:
                            meta["not_run"].append({"ep": ep, "tokens": tokens, "scheme": scheme, "combine_wire": combine,
                                                    "routing": routing, "bounded": bounded})
                            continue
                        c = EmulatedCase(ep, experts, tokens, scheme, EMULATED_SCHEMES[scheme], combine, routing, bounded,
                                         tokens_by_rank=toks)
                        try:
                            bound = max(toks) if bounded else None
                            bound = max(bound, 1) if bounded else None
                            c.rank_us_by_rank, per_step = timed_steps(emu, routes, bound)
                            c.experts_us_by_rank = [s[STEPS.index("experts")] for s in per_step]
                            slowest = max(range(ep), key=lambda r: c.rank_us_by_rank[r])
                            c.rank_us, c.experts_us = c.rank_us_by_rank[slowest], c.experts_us_by_rank[slowest]
                            c.steps_us = dict(zip(STEPS, per_step[slowest]))
                            c.step_graph_us = step_graph_us(emu, routes, bound)
                            c.nvlink_model_us = nvlink_model_us(routes, ep, experts, ws0.layout.row_bytes,
                                                                ws0.layout.comb_bytes, topk)
                            floors = []
                            for r in range(ep):
                                _, lid, _, _ = rank_share(routes, r, experts)
                                c.live_pairs_by_rank.append(int(lid.numel()))
                                c.experts_hit_by_rank.append(int(torch.unique(lid).numel()))
                                floors.append(expert_floor(experts_hit=int(torch.unique(lid).numel()), pairs=int(lid.numel()),
                                                           hidden=hidden, intermediate=inter, weight_fmt=weight_fmt,
                                                           a_fmt=plans[0].math.a_format,
                                                           hbm_bytes_per_s=sheet.hbm_bytes_per_s,
                                                           mma_flops_per_s=sheet.mma_flops_per_s))
                            worst = max(floors, key=lambda f: f.us)
                            c.floor_us, c.floor_bound = worst.us, worst.bound
                            measured = measured_peaks(meta.get("ceilings", {}))
                            if measured is not None:
                                c.weight_stream_us = (max(c.experts_hit_by_rank) * weight_bytes_per_expert(hidden, inter, weight_fmt)
                                                      / measured[0] * 1e6)
                                c.rank_x_weight_stream = c.rank_us / c.weight_stream_us
                                if "fp8" in measured[1]:
                                    _, lid, _, _ = rank_share(routes, slowest, experts)
                                    c.floor_measured_us = expert_floor(
                                        experts_hit=c.experts_hit_by_rank[slowest], pairs=int(lid.numel()), hidden=hidden,
                                        intermediate=inter, weight_fmt=weight_fmt, a_fmt=plans[0].math.a_format,
                                        hbm_bytes_per_s=measured[0], mma_flops_per_s=measured[1]).us
                                    c.rank_x_floor_measured = c.rank_us / c.floor_measured_us
                            fmt_peers = [p for p in ready_peers if p.weights_fmt == weight_fmt]  # the scheme's weights
                            if ready_peers and not fmt_peers:
                                c.peers_error = f"no peer asked for takes {weight_fmt} weights"
                            elif fmt_peers:
                                try:
                                    link_peers(c, cases, fmt_peers, routes, slowest, ep, experts, weights, spec, args,
                                               meta, peer_results)
                                except Exception as exc:  # noqa: BLE001 - the project's figures of the case stand
                                    c.peers_error = f"{type(exc).__name__}: {str(exc)[:400]}"
                            if not args.no_baseline and bounded:
                                xs, lid, lw, rows = rank_share(routes, 0, experts)
                                if lid.numel():
                                    naive, _ = graph_or_eager(lambda: naive_torch_layer(xs, lid, lw, bf16_rank0, spec.swiglu_limit, rows))  # noqa: B023
                                    c.naive_torch_us, _ = time_fn(naive, use_graph=False)
                            elif cases and cases[-1].tokens == tokens and cases[-1].bounded:
                                c.naive_torch_us = cases[-1].naive_torch_us  # same routes; the baseline knows no bound
                        except Exception as exc:  # noqa: BLE001 - one failing case must not sink the sweep
                            c.error = f"{type(exc).__name__}: {str(exc)[:400]}"
                            torch.cuda.synchronize()
                        cases.append(c)
                        print(line(c), flush=True)
                        save()
            del emu
            clear_transport_cache()
            torch.cuda.empty_cache()


def link_peers(c: EmulatedCase, cases: list[EmulatedCase], ready, routes, slowest: int, ep: int, experts: int, weights,
               spec, args, meta: dict, peer_results: list) -> None:
    """The peers' µs for ``c``: run on the slowest rank's share once per routes and weight format (ep, routing,
    tokens, MXFP4 or block-FP8; the first case of them picks the rank), reused by the other schemes / wires / bound
    of the same routes on weights of that format.
    The peers' converted weights are dropped after their run: the emulated ranks hold every rank's
    experts, and the peers' copies of one rank's must not crowd out the cases that follow."""
    from .peers import release_all

    from .layer_common import WEIGHT_FMT_OF

    key = (c.ep, c.routing, c.tokens, WEIGHT_FMT_OF[c.scheme])
    done = next((o for o in cases if (o.ep, o.routing, o.tokens, WEIGHT_FMT_OF[o.scheme]) == key and o.peer_rank >= 0),
                None)
    if done is not None:
        c.peer_rank, c.peers_us = done.peer_rank, dict(done.peers_us)
    else:
        c.peer_rank = slowest
        for r in run_rank_peers(ready, routes, slowest, ep, experts, weights, spec, args, meta.get("ceilings", {})):
            peer_results.append(r)
            if r.usable():
                c.peers_us[r.peer] = r.us
        release_all(ready)
    rank = c.peer_rank
    rank_us, experts_us = c.rank_us_by_rank[rank], c.experts_us_by_rank[rank]
    c.rank_over_peer = {name: rank_us / us for name, us in c.peers_us.items()}
    c.experts_over_peer = {name: experts_us / us for name, us in c.peers_us.items()}


def line(c: EmulatedCase) -> str:
    return (f"EP{c.ep} E{c.experts:<4d} T{c.tokens:<5d} {c.scheme} {c.dispatch_wire}/{c.combine_wire:18s} {c.routing:7s} "
            f"{'bound' if c.bounded else 'MTPR ':5s} rank {c.rank_us:9.1f} experts {c.experts_us:9.1f} graph/rank "
            f"{c.step_graph_us:9.1f} nvlink(model) {c.nvlink_model_us:7.1f} naive {c.naive_torch_us:9.1f} "
            f"floor {c.floor_us:8.1f} {c.error[:160]}")


def summary(cases: list[EmulatedCase]) -> dict:
    """The issue's targets, read off the cases (uniform routing, first scheme / wire)."""
    def find(ep, t, bounded, scheme="a8w4", combine="bf16"):
        for c in cases:
            if (c.ep, c.tokens, c.bounded, c.scheme, c.combine_wire, c.routing) == (ep, t, bounded, scheme, combine, "uniform"):
                return c
        return None

    out = {}
    c = find(8, 8, True)
    if c:
        out["ep8_t8_bounded_rank_us"] = c.rank_us
    for t in (8, 32, 128):
        b, u = find(8, t, True), find(8, t, False)
        if b and u:
            out[f"ep8_t{t}_unbounded_over_bounded"] = u.rank_us / b.rank_us
    for ep in (8, 2):
        c = find(ep, 8192, True)
        if c:
            out[f"ep{ep}_t8192_rank_over_experts"] = c.rank_us / c.experts_us
            for name, ratio in c.rank_over_peer.items():
                out[f"ep{ep}_t8192_rank_over_{name}"] = ratio
    for t in (8, 128):  # issue 48: the slowest rank against the busiest rank's weight stream at the measured copy rate
        c = find(8, t, True)
        if c and c.rank_x_weight_stream == c.rank_x_weight_stream:
            out[f"ep8_t{t}_bounded_rank_x_weight_stream"] = c.rank_x_weight_stream
    return out


def run_emulated(args: argparse.Namespace) -> int:
    from .bench_experts import card_name, environment
    from .floor import datasheet_ceilings
    from .peers import describe, select
    from .timing import measure_ceilings

    if not torch.cuda.is_available():
        print("bench layer --emulate needs a CUDA GPU", file=sys.stderr)
        return 2
    meta = environment(argparse.Namespace(**{**vars(args), "hidden": 7168, "intermediate": 3072, "topk": 6}),
                       "benchmarks.bench_layer")
    meta["what"] = ("megamoe bench layer --ep N --emulate: N EP ranks of one DSV4-Pro layer (384 experts) in one process "
                    "on one GPU, each rank's device P2P forward timed on its own (CUDA events, kernels only)")
    meta["nvlink_model"] = {"bytes_per_s_per_direction": NVLINK_BYTES_PER_S, "barrier_latency_us": BARRIER_LATENCY_US,
                            "note": "a model, not a measurement: dispatch + combine bytes to other ranks / bandwidth + "
                                    "2 barriers x latency, the slowest rank"}
    meta["zipf_s"] = ZIPF_S
    meta["ceilings"] = {**datasheet_ceilings(torch.device("cuda")), **measure_ceilings(torch.device("cuda"))}
    meta["not_run"] = []  # cases left out by --budget-s
    ready_peers, peer_results = [], []
    if args.peers is not None:
        ready_peers, skipped = select(args.peers, args.peer_tune_cache)
        meta["peers"] = describe(ready_peers, skipped)
    cases: list[EmulatedCase] = []
    t0 = time.time()

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": {**meta, "seconds": round(time.time() - t0, 1)}, "summary": summary(cases),
                           "cases": [asdict(c) for c in cases], "peers": [asdict(r) for r in peer_results]},
                          f, indent=1, default=str)

    eps = [args.ep] if args.ep > 1 else [8, 2]
    for ep in eps:
        experts = args.experts_total // ep
        run_group(ep, experts, args, cases, meta, save, ready_peers, peer_results, t0)
    meta["complete"] = not meta["not_run"]
    save()
    print(json.dumps(summary(cases), indent=1))
    if args.plot:
        plot_emulated(cases, args.plot, card_name(meta))
    return 0


def plot_emulated(cases: list[EmulatedCase], path: str, card: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [c for c in cases if not c.error and c.routing == "uniform"]
    panels = sorted({(c.ep, c.scheme, c.combine_wire) for c in ok}, key=lambda k: (-k[0], k[1], k[2]))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4 * max(1, len(panels)), 3.6), squeeze=False)
    for ax, key in zip(axes[0], panels):
        sel = [c for c in ok if (c.ep, c.scheme, c.combine_wire) == key]
        for bounded, style, label in ((True, "o-", "rank, bound passed"), (False, "o:", "rank, no bound (MTPR 8192)")):
            pts = sorted((c for c in sel if c.bounded == bounded), key=lambda c: c.tokens)
            ax.plot([c.tokens for c in pts], [c.rank_us for c in pts], style, label=label, markersize=4)
        pts = sorted((c for c in sel if c.bounded), key=lambda c: c.tokens)
        tok = [c.tokens for c in pts]
        for attr, style, label in (("experts_us", "s--", "its experts alone"), ("naive_torch_us", "x-", "naive torch (its share)"),
                                   ("floor_us", "k--", "floor"), ("nvlink_model_us", "g-.", "NVLink (model)")):
            ax.plot(tok, [getattr(c, attr) for c in pts], style, label=label, markersize=4)
        for name in sorted({n for c in pts for n in c.peers_us}):  # --peers: on the same rank's share
            ax.plot(tok, [c.peers_us.get(name, float("nan")) for c in pts], "v-.", label=f"{name} (peer, EP rank)",
                    markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"EP {key[0]} ({cases[0].experts * cases[0].ep // key[0]} local), {key[1]}, combine {key[2][:4]}",
                     fontsize=9)
        ax.set_xlabel("tokens per rank")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("µs per rank (emulated, kernels only)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"megamoe bench layer --emulate: one EP rank of DSV4-Pro (384 experts) on one {card}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
