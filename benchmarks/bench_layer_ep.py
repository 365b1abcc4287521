"""`megamoe bench layer --ep N`: the device P2P forward with N rank processes, each replaying its
CUDA graph of one layer forward, beside the same run's naive torch layer and floor.

Ranks: one process each, on GPU ``rank`` when N GPUs are visible (the real per-layer time), else all
on GPU 0 (a PROXY: the ranks time-slice one GPU, every barrier waits for the other contexts' time
slices; the JSON says which in meta.placement). Arenas: MEGA_DISPATCH=ipc (CUDA IPC), the receive
regions sized by ``max_tokens_across_ranks`` = the bucket's T (what an engine replaying one graph
size on all DP ranks passes). Per case, from the same run:

  layer_us        rank 0's replay time of the whole forward (dispatch, barrier, experts writing into
                  the sources' combine regions, barrier, top-k sum), all ranks replaying together
  layer_us_max    the slowest rank's
  experts_us      rank 0's experts alone on the pairs it received (one graph, ranks not contending)
  naive_torch_us  the torch layer of bench layer (argsort + bf16 grouped GEMMs) on ALL ranks' tokens
                  and experts in one process: the work the N ranks share on one GPU
  floor_us        max(all ranks' active expert bytes / HBM, all FLOPs / bf16 peak): one GPU's floor
                  for the whole step when the ranks share it; per GPU with N GPUs
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field

import torch

REPLAYS = 20


@dataclass
class EPLayerCase:
    ep: int
    experts_per_rank: int
    tokens: int
    scheme: str
    dispatch_wire: str
    combine_wire: str
    layer_us: float = float("nan")
    layer_us_max: float = float("nan")
    experts_us: float = float("nan")
    naive_torch_us: float = float("nan")
    floor_us: float = float("nan")
    layer_us_by_rank: list = field(default_factory=list)
    error: str = ""


def _replays_us(graph, n: int = REPLAYS) -> float:
    """µs per replay of n back-to-back replays, started together on every rank (a host barrier)."""
    import torch.distributed as dist

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def _rank_worker(rank: int, world: int, cases: list[dict], mtpr: int, seed: int) -> list[dict]:
    import torch.distributed as dist

    from megamoe_backend.experts import ExpertPairs
    from megamoe_backend.layer import MegaMoELayer
    from megamoe_backend.plan import build_plan
    from megamoe_backend.spec import preset
    from megamoe_backend.transport import clear_transport_cache

    from .bench_experts import capture_graph, make_weights
    from .layer_common import Routes, bench_knobs

    gpu = rank if torch.cuda.device_count() >= world else 0
    torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu)
    out = []
    weights_by_n: dict[int, tuple] = {}
    for c in cases:
        n_local = c["experts_per_rank"]
        if n_local not in weights_by_n:
            weights_by_n.clear()
            spec0 = preset("dsv4-pro")
            # this rank's own experts (the numbers do not matter for timing; the shapes and formats do)
            weights_by_n[n_local] = make_weights(n_local, spec0.hidden_size, spec0.moe_intermediate_size, device, seed + rank)
        fp4, _ = weights_by_n[n_local]
        spec = preset("dsv4-pro").scaled(n_routed_experts=n_local * world)
        knobs = bench_knobs(dispatch_wire=c["dispatch_wire"], combine_wire=c["combine_wire"], max_tokens_per_rank=mtpr,
                            transport="ipc")
        plan = build_plan(spec, knobs, rank, world, quant=c["scheme"], device_type="cuda")
        layer = MegaMoELayer(plan, fp4, group=dist.group.WORLD, device=device)
        routes = Routes(c["tokens"], n_local * world, plan.topk, plan.hidden, device, seed + 17 * rank)
        fwd = lambda: layer(routes.x, routes.ids, routes.w, max_tokens_across_ranks=c["tokens"])  # noqa: E731
        fwd()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fwd()
        layer_us = _replays_us(graph)
        layer.raise_if_bad_input()
        ws, n = layer.workspace, plan.ep_size * c["tokens"] * plan.topk
        rows = ws.wire.view(ws.recv_rows[: plan.ep_size * c["tokens"]].clone(), plan.hidden)
        pairs = ExpertPairs(ws.pair_row[:n], ws.recv_slot[:n].clone(), ws.recv_weight[:n].clone())
        sink = torch.empty(n, plan.combine.row_bytes(plan.hidden), dtype=torch.uint8, device=device)
        experts = capture_graph(lambda: layer.provider.forward_wire(rows, pairs, layer.weights, plan.math, plan.combine,
                                                                    out=sink))
        torch.cuda.synchronize()
        dist.barrier()
        experts_us = _replays_single(experts.replay) if rank == 0 else float("nan")
        dist.barrier()
        out.append({"layer_us": layer_us, "experts_us": experts_us})
        del graph, experts
        clear_transport_cache()
        torch.cuda.empty_cache()
    return out


def _replays_single(call, n: int = REPLAYS) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def _baselines(c: EPLayerCase, device, seed: int) -> None:
    """naive torch and floor of the whole step (all ranks' tokens and experts) in this process."""
    from megamoe_backend.spec import preset

    from .bench_experts import graph_or_eager, make_weights, time_fn, weight_bytes_per_expert
    from .floor import datasheet_for
    from .layer_common import Routes, naive_torch_layer

    spec = preset("dsv4-pro")
    n_exp, tokens = c.experts_per_rank * c.ep, c.tokens * c.ep
    routes = Routes(tokens, n_exp, spec.num_experts_per_tok, spec.hidden_size, device, seed)
    active = int(torch.unique(routes.ids).numel())
    wbytes = active * weight_bytes_per_expert(spec.hidden_size, spec.moe_intermediate_size, "mxfp4")
    flops = 6 * tokens * spec.num_experts_per_tok * spec.hidden_size * spec.moe_intermediate_size
    gpus = c.ep if torch.cuda.device_count() >= c.ep else 1
    sheet = datasheet_for(torch.cuda.get_device_name(device))
    c.floor_us = max(wbytes / sheet.hbm_bytes_per_s, flops / sheet.mma_flops_per_s["bf16"]) * 1e6 / gpus
    _, bf16 = make_weights(n_exp, spec.hidden_size, spec.moe_intermediate_size, device, seed)
    naive, _ = graph_or_eager(lambda: naive_torch_layer(routes.x, routes.ids, routes.w, bf16, spec.swiglu_limit))
    c.naive_torch_us, _ = time_fn(naive, use_graph=False)
    del bf16
    torch.cuda.empty_cache()


def run_ep(args: argparse.Namespace) -> int:
    from megamoe_backend.parallel.spawn import spawn_ranks

    from .bench_experts import environment
    from .layer_common import COMBINES, SCHEMES

    device = torch.device("cuda")
    ep = args.ep
    meta = environment(argparse.Namespace(**{**vars(args), "hidden": 7168, "intermediate": 3072, "topk": 6}),
                       "benchmarks.bench_layer")
    meta["what"] = f"megamoe bench layer --ep {ep}: the device P2P forward (MEGA_DISPATCH=ipc), one CUDA graph per rank"
    gpus = torch.cuda.device_count()
    meta["placement"] = (f"{ep} ranks on {ep} GPUs: real per-layer times" if gpus >= ep else
                         f"PROXY: {ep} rank processes time-slice ONE GPU ({torch.cuda.get_device_name()}); each barrier "
                         "waits for the other contexts' time slices, so layer_us is not a per-GPU layer time")
    cases = [EPLayerCase(ep, e, t, s, SCHEMES[s], comb) for e in args.experts for s in args.schemes
             for comb in args.combine_wires for t in args.tokens if comb in COMBINES]
    t0 = time.time()
    try:
        per_rank = spawn_ranks(ep, _rank_worker, [asdict(c) for c in cases], args.mtpr, args.seed, backend="gloo",
                               timeout_s=3000, pg_timeout_s=1800)
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON
        per_rank = None
        for c in cases:
            c.error = f"{type(exc).__name__}: {str(exc)[-600:]}"
    for i, c in enumerate(cases):
        if per_rank is not None:
            c.layer_us_by_rank = [r[i]["layer_us"] for r in per_rank]
            c.layer_us, c.layer_us_max = c.layer_us_by_rank[0], max(c.layer_us_by_rank)
            c.experts_us = per_rank[0][i]["experts_us"]
        if not args.no_baseline:
            try:
                _baselines(c, device, args.seed)
            except Exception as exc:  # noqa: BLE001
                c.error += f" baseline: {type(exc).__name__}: {str(exc)[:200]}"
        print(f"ep{ep} E{c.experts_per_rank}/rank T{c.tokens} {c.scheme} {c.combine_wire}: layer {c.layer_us:.1f} "
              f"(max rank {c.layer_us_max:.1f}) experts {c.experts_us:.1f} naive {c.naive_torch_us:.1f} "
              f"floor {c.floor_us:.1f} {c.error[:200]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {**meta, "seconds": round(time.time() - t0, 1)}, "cases": [asdict(c) for c in cases]}, f,
                      indent=1, default=str)
    if args.plot:
        plot_ep(cases, args.plot, meta["placement"])
    return 0


def plot_ep(cases: list[EPLayerCase], path: str, placement: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [c for c in cases if not c.error]
    panels = sorted({(c.experts_per_rank, c.scheme, c.combine_wire) for c in ok})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4 * max(1, len(panels)), 3.4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        pts = sorted((c for c in ok if (c.experts_per_rank, c.scheme, c.combine_wire) == key), key=lambda c: c.tokens)
        tok = [c.tokens for c in pts]
        for attr, style, label in (("layer_us", "o-", "layer, rank 0 (graph)"), ("layer_us_max", "o:", "slowest rank"),
                                   ("experts_us", "s--", "rank 0 experts alone"), ("naive_torch_us", "x-", "naive torch (all)"),
                                   ("floor_us", "k--", "floor")):
            ax.plot(tok, [getattr(c, attr) for c in pts], style, label=label, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{key[0]} experts/rank, {key[1]}, combine {key[2][:4]}", fontsize=9)
        ax.set_xlabel("tokens per rank")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("µs per layer")
    axes[0][0].legend(fontsize=7)
    proxy = "PROXY: ranks time-slice one GPU" if placement.startswith("PROXY") else "one GPU per rank"
    fig.suptitle(f"megamoe bench layer --ep {cases[0].ep if cases else '?'}\n({proxy})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
