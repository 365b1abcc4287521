"""`megamoe bench experts`: the Triton experts against torch._grouped_mm and the physical floor.

One GPU. DeepSeek-V4-Pro expert shapes by default (hidden 7168, intermediate 3072, top-k 6), local
expert counts 192 (EP2) and 48 (EP8 share), uniform random routing, token buckets of T tokens per
rank (P = T x top-k pairs). Per case: median µs of a CUDA-graph replay of one full experts forward
(replays back to back, as a serving GPU runs them; the SM clock, power and power-cap state NVML
reports meanwhile are recorded: gpu_clock.py), beside it the median of single replays after the
GPU idled (``us_isolated``, ``time_isolated``: near full clock; on the H200 here back-to-back replays
run power-capped), effective HBM TB/s, TFLOP/s, relL2 against an fp32
computation (dequantised weights, unquantised activations), relL2 against the exact-math torch
reference (same quantisation, fp64; for wire outputs passed through the same wire), and the floor
max(weight bytes of the experts actually hit / HBM BW, FLOPs / MMA peak) of floor.py: the FP8 peak for
MX activations (A8W4 / A4W4 run FP8 MMA on Hopper), the bf16 one for bf16 activations (A16W4, bf16, the
torch baseline). ``floor_us`` / ``x_floor`` use the card's datasheet ceilings (``floor_peak`` names the
MMA peak); ``floor_measured_us`` / ``x_floor_measured`` the ceilings measured at the start of the same
run (a copy, a bf16 GEMM, an FP8 ``torch._scaled_mm``: meta.ceilings).

What a forward returns (``--combine-wire``, default bf16 = the layer's default MEGA_COMBINE_WIRE):
the route-weighted row of every pair as the layer sends it back, i.e. ``forward_wire`` (GEMM2 writes
the combine wire row itself); ``fp32`` times ``forward`` (fp32 rows, the provider's other contract,
what this bench timed before the wire output existed). With ``--variants`` the other two outputs of
the default tile are timed too.

Baseline ("torch_grouped_mm"): sort + gather, torch._grouped_mm on the DEQUANTISED bf16 weights,
SwiGLU in torch, torch._grouped_mm, route weight, scatter into rows of the same output format
(bf16: the fp32 product rounded once; fp8 wire: WireFormat.encode); timed the same way.

Peers (``--peers``, benchmarks/peers.py): after the project's cases of each bucket, the MoE kernels a user
would run instead (FlashInfer CUTLASS Humming / W4A16, triton_kernels matmul_ogs), on the same routing
and the same MXFP4 weights, timed the same way; each peer's whole MoE call (one route-weighted row per
token) beside this bench's experts half, relL2 per token against the same fp32 reference
(``rel_l2_tokens`` is the project's on that footing), ratios to the project's figures and to the run's
measured ceilings (JSON ``peers``; peers that cannot run here: ``meta.peers.skipped`` with the reason).

Under TRITON_INTERPRET=1 on CPU this runs tiny shapes eagerly (no graph, no baseline): a smoke test.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from megamoe_backend.experts import ExpertMath, ExpertPairs, ExpertWeights, swiglu
from megamoe_backend.experts.triton.config import TileConfig, bucket_class, default_config, interpreting
from megamoe_backend.formats.wire import combine_wire
from megamoe_backend.layer.reference import rel_l2

from . import peers as peer_bench
from .floor import (
    datasheet_ceilings,
    datasheet_of,
    expert_floor,
    expert_flops,
    experts_hit,
    weight_bytes_per_expert,
)
from .bench_data import (TokenCheck, make_block_fp8_weights, make_routing, make_weights,  # noqa: F401 - re-exported
                         output_values)
from .gpu_clock import ClockSampler
from .references import check_subset, check_tokens, subset_reference
from .timing import CEILING_GEMM_N, capture_graph, graph_or_eager, measure_ceilings, time_fn, time_isolated  # noqa: F401 - re-exported

SCHEMES = {  # name -> (ExpertMath.quant, weight format)
    "a8w4": ("a8w4", "mxfp4"),
    "a4w4": ("a4w4", "mxfp4"),
    "a16w4": ("bf16", "mxfp4"),
    "bf16": ("bf16", "bf16"),
    "fp8_block": ("fp8_block", "fp8_block"),  # DeepSeek V3 / R1 FP8 checkpoints (make_block_fp8_weights)
}

# Extra tile configs tried with --variants (scheme a8w4, first expert count, default decoder = frag8),
# per bucket class; the frag, split and dot_scaled decoders run beside them on their defaults.
VARIANTS = {
    "decode": [
        TileConfig(block_m=16, block_n1=256, block_n2=256, block_k=128, num_warps=4, num_stages=3),
        TileConfig(block_m=16, block_n1=256, block_n2=256, block_k=128, num_warps=4, num_stages=4),
    ],
    "mid": [
        TileConfig(block_m=64, block_n1=256, block_n2=256, block_k=128, num_warps=4, num_stages=3, tail_m=32),
        TileConfig(block_m=64, block_n1=128, block_n2=128, block_k=128, num_warps=4, num_stages=4, tail_m=32),
    ],
    "prefill": [
        TileConfig(block_m=128, block_n1=128, block_n2=128, block_k=128, num_warps=4, num_stages=3, tail_m=16),  # no ride
        TileConfig(block_m=128, block_n1=128, block_n2=128, block_k=128, num_warps=4, num_stages=4),
        TileConfig(block_m=128, block_n1=256, block_n2=256, block_k=128, num_warps=8, num_stages=4),
    ],
}


# What the JSON says about its floors (meta.floor): which peak each case's floor_us divides by.
FLOOR_META = {
    "model": "max(weight bytes of the experts hit / HBM, 6 P H I FLOPs / MMA peak): benchmarks/floor.py",
    "floor_us": "the card's datasheet ceilings (meta.ceilings datasheet, hbm_tbs, bf16_tflops, fp8_tflops)",
    "floor_measured_us": "this run's measured ceilings (meta.ceilings measured_copy_tbs, measured_*_gemm_tflops)",
    "mma_peak": "fp8 for MX activations on MXFP4 weights (A8W4, A4W4: FP8 MMA on Hopper), bf16 otherwise "
                "(A16W4, bf16, the torch baseline); per case: floor_peak",
    "ratios": "x_copy_measured = us / (MXFP4 bytes of the experts hit at this run's measured copy rate); "
              "x_fp8_gemm_measured = us / (6 P H I FLOPs at this run's measured cuBLAS FP8 rate, torch._scaled_mm "
              "8192^3): the same two for every figure, the project's and the peers' (ceiling_ratios)",
}

OUTPUTS = ("bf16", "fp8_blockwise_1x32", "fp32")  # --combine-wire choices; --variants times the default tile with each


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, nargs="+", default=[192, 48], help="local experts per rank")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 128, 1024, 8192], help="tokens per rank")
    parser.add_argument("--topk", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--schemes", nargs="+", default=["a8w4", "a4w4", "a16w4", "bf16"], choices=sorted(SCHEMES))
    parser.add_argument("--swiglu-limit", type=float, default=10.0, help="SwiGLU clamp (DeepSeek V4: 10); <= 0 disables")
    parser.add_argument("--decoder", default="auto", choices=["auto", "frag8", "frag", "split", "dot_scaled", "manual"])
    parser.add_argument("--variants", action="store_true", help="also time alternative tile configs / decoders / outputs (a8w4)")
    parser.add_argument("--combine-wire", default="bf16", choices=list(OUTPUTS),
                        help="what a forward returns: the layer's combine wire rows (forward_wire) or fp32 rows (forward)")
    parser.add_argument("--gemm", default="auto", choices=["auto", "triton"],
                        help="who runs the frag8 GEMMs of the main configs (MEGA_EXPERTS_GEMM's values; the sm_90a "
                             "CUDA GEMMs are research code: benchmarks/research/cuda_gemms)")
    parser.add_argument("--humming", action="store_true",
                        help="also time the humming provider (experts/humming/: humming-kernels' GEMMs, what "
                             "MEGA_EXPERTS_GEMM=humming runs) beside the Triton experts, A8W4 and fp8_block (needs sm_90 "
                             "and humming-kernels)")
    parser.add_argument("--no-baseline", action="store_true", help="skip torch._grouped_mm")
    parser.add_argument("--no-block-fp8-peer", action="store_true",
                        help="with --schemes fp8_block: skip vLLM's Triton block-FP8 fused_experts (peer_vllm_block_fp8.py)")
    parser.add_argument("--check-pairs", type=int, default=256, help="pairs sampled for the relL2 checks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write results JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--replot", default=None, metavar="JSON", help="only draw --plot from a saved JSON (no GPU)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new (experts, tokens) group after this many seconds (the JSON lists what did not run)")
    peer_bench.add_arguments(parser)


@dataclass
class Case:
    experts: int
    tokens: int
    pairs: int
    scheme: str
    provider: str
    decoder: str = ""
    config: str = ""
    out: str = "fp32"  # fp32 rows (forward) or the combine wire they are returned in (forward_wire)
    us: float = float("nan")  # median of back-to-back graph replays (what a serving GPU sees)
    us_isolated: float = float("nan")  # median of single replays after the GPU idled (time_isolated): near full clock
    graph: bool = False
    active_experts: int = 0
    weight_bytes: int = 0
    hbm_bytes: int = 0
    flops: int = 0
    floor_us: float = float("nan")  # floor.expert_floor, datasheet ceilings, the MMA peak of floor_peak
    floor_peak: str = ""  # the MMA peak floor_us divides by: "fp8" (MX activations) or "bf16"
    floor_bound: str = ""  # what sets floor_us: "hbm" (weights of the experts hit) or "mma"
    floor_fp8_us: float = float("nan")  # the floor with the FP8 peak, whatever the scheme
    floor_bf16_us: float = float("nan")  # the floor with the bf16 peak (what floor_us was before issue 35)
    floor_measured_us: float = float("nan")  # floor_us with this run's measured copy / GEMM ceilings
    mma_floor_us: float = float("nan")  # FLOPs / the floor_peak datasheet peak
    x_floor: float = float("nan")
    x_floor_isolated: float = float("nan")
    x_floor_measured: float = float("nan")
    hbm_tbs: float = float("nan")
    tflops: float = float("nan")
    mma_peak_frac: float = float("nan")  # tflops / the floor_peak datasheet peak
    rel_l2_fp32: float = float("nan")
    rel_l2_ref: float = float("nan")
    rel_l2_tokens: float = float("nan")  # per-token sums of the pairs vs fp32: the peers' relL2 (references.token_reference)
    x_copy_measured: float = float("nan")  # ceiling_ratios: us / weight bytes at the measured copy rate
    x_fp8_gemm_measured: float = float("nan")  # ceiling_ratios: us / FLOPs at the measured cuBLAS FP8 rate
    clock: dict = field(default_factory=dict)  # gpu_clock.ClockSampler.stats() while timed ({}: no NVML)
    error: str = ""


def act_bytes(hidden: int, fmt: str | None) -> float:
    return {None: 2.0 * hidden, "fp8": hidden * (1 + 1 / 32), "fp4": hidden * (0.5 + 1 / 32),
            "fp8_g128": hidden * (1 + 4 / 128)}[fmt]


# -------------------------------------------------------------------------------------- baseline
def grouped_mm_forward(x: torch.Tensor, pairs: ExpertPairs, wd: ExpertWeights, limit: float | None,
                       out_fmt: str = "fp32") -> torch.Tensor:
    """Naive torch experts: sort, gather, two torch._grouped_mm on bf16 weights, SwiGLU, scatter
    (into fp32 rows, or bf16 / fp8 combine wire rows: ``out_fmt``)."""
    n_exp = wd.num_experts
    order = torch.sort(pairs.slot, stable=True).indices
    counts = torch.zeros(n_exp, dtype=torch.int64, device=x.device).index_add_(0, pairs.slot, torch.ones_like(pairs.slot))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[pairs.row[order]]
    h = torch._grouped_mm(xs, wd.w1.transpose(1, 2), offs=offs)
    act = swiglu(h.float(), wd.gate_up_layout, limit).to(torch.bfloat16)
    y = torch._grouped_mm(act, wd.w2.transpose(1, 2), offs=offs)
    weighted = y.float() * pairs.weight[order, None]
    if out_fmt == "fp32":
        out = torch.empty(len(pairs), wd.hidden, dtype=torch.float32, device=x.device)
        out[order] = weighted
        return out
    wire = combine_wire(out_fmt)
    out = torch.empty(len(pairs), wire.row_bytes(wd.hidden), dtype=torch.uint8, device=x.device)
    out[order] = wire.encode(weighted)
    return out


def out_bytes(hidden: int, out_fmt: str) -> int:
    """Bytes of one pair's output row."""
    return 4 * hidden if out_fmt == "fp32" else combine_wire(out_fmt).row_bytes(hidden)


# ------------------------------------------------------------------------------------------- run
def describe(cfg: TileConfig | None) -> str:
    if cfg is None:
        return ""
    tail = f" t{cfg.tail_m}" if cfg.tail_m else ""  # short last tiles (TileConfig.tail_m)
    tail += "+ride" if cfg.tail_ride else ""  # ... riding in their expert's previous tile (TileConfig.tail_ride)
    tail += f" r{cfg.max_registers}" if cfg.max_registers else ""  # register cap
    tail += f" tr{cfg.tail_max_registers}" if cfg.tail_max_registers else ""  # the short launch's own cap
    return f"m{cfg.block_m} n{cfg.block_n1}/{cfg.block_n2} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}{tail}"


def measured_peaks(ceilings: dict) -> tuple[float, dict[str, float]] | None:
    """(HBM bytes/s, {MMA kind: FLOP/s}) that measure_ceilings found, for floor.expert_floor; None
    where it measured nothing (CPU, interpreter, or an older JSON's meta)."""
    if "measured_copy_tbs" not in ceilings:
        return None
    mma = {"bf16": ceilings["measured_bf16_gemm_tflops"] * 1e12}
    if "measured_fp8_gemm_tflops" in ceilings:
        mma["fp8"] = ceilings["measured_fp8_gemm_tflops"] * 1e12
    return ceilings["measured_copy_tbs"] * 1e12, mma


def case_floors(ceilings: dict | None, **shape) -> dict:
    """The floor fields both benches write (floor.expert_floor of ``shape``): floor_us, floor_peak,
    floor_bound, mma_floor_us with the card's datasheet ceilings (as ``ceilings`` records them:
    floor.datasheet_of); floor_fp8_us / floor_bf16_us with either datasheet peak; floor_measured_us with
    ``ceilings``' measured ones (meta.ceilings; NaN if none)."""
    sheet = datasheet_of(ceilings)
    f = expert_floor(**shape, hbm_bytes_per_s=sheet.hbm_bytes_per_s, mma_flops_per_s=sheet.mma_flops_per_s)
    flops = expert_flops(shape["pairs"], shape["hidden"], shape["intermediate"])
    out = {"floor_us": f.us, "floor_peak": f.mma, "floor_bound": f.bound, "mma_floor_us": f.mma_us,
           "floor_fp8_us": max(f.hbm_us, flops / sheet.mma_flops_per_s["fp8"] * 1e6),
           "floor_bf16_us": max(f.hbm_us, flops / sheet.mma_flops_per_s["bf16"] * 1e6),
           "floor_measured_us": float("nan")}
    measured = measured_peaks(ceilings or {})
    if measured is not None and f.mma in measured[1]:
        out["floor_measured_us"] = expert_floor(**shape, hbm_bytes_per_s=measured[0], mma_flops_per_s=measured[1]).us
    return out


def ceiling_ratios(us: float, ceilings: dict | None, *, experts_hit: int, pairs: int, hidden: int, intermediate: int,
                   weight_fmt: str = "mxfp4") -> dict:
    """A figure against the ceilings measured at the start of the run (meta.ceilings; issue 48): x_copy =
    us / (the weights of the experts hit streamed at the measured copy rate), x_fp8_gemm = us / (its
    FLOPs at the measured cuBLAS FP8 rate). NaN where the run measured none (CPU, an older JSON)."""
    ceilings = ceilings or {}
    out = {"x_copy_measured": float("nan"), "x_fp8_gemm_measured": float("nan")}
    if ceilings.get("measured_copy_tbs"):
        stream_us = experts_hit * weight_bytes_per_expert(hidden, intermediate, weight_fmt) / (ceilings["measured_copy_tbs"] * 1e6)
        out["x_copy_measured"] = us / stream_us if stream_us else float("nan")
    if ceilings.get("measured_fp8_gemm_tflops"):
        out["x_fp8_gemm_measured"] = us / (expert_flops(pairs, hidden, intermediate) / (ceilings["measured_fp8_gemm_tflops"] * 1e6))
    return out


def fill_metrics(c: Case, hidden: int, inter: int, wfmt: str, a_fmt: str | None, ceilings: dict | None = None) -> None:
    """Bytes, FLOPs, floors (case_floors; ``ceilings``: meta.ceilings, for the measured floor) and the
    rates of a timed case."""
    c.weight_bytes = c.active_experts * weight_bytes_per_expert(hidden, inter, wfmt)
    a2 = act_bytes(inter, a_fmt)  # bytes per A2 row (payload + scales)
    c.hbm_bytes = int(c.weight_bytes + c.pairs * (act_bytes(hidden, a_fmt) + 2 * a2 + out_bytes(hidden, c.out)))
    c.flops = expert_flops(c.pairs, hidden, inter)
    for key, value in case_floors(ceilings, experts_hit=c.active_experts, pairs=c.pairs, hidden=hidden,
                                  intermediate=inter, weight_fmt=wfmt, a_fmt=a_fmt).items():
        setattr(c, key, value)
    c.x_floor_isolated = c.us_isolated / c.floor_us
    if c.us == c.us:
        c.x_floor = c.us / c.floor_us
        c.x_floor_measured = c.us / c.floor_measured_us
        c.hbm_tbs = c.hbm_bytes / c.us / 1e6
        c.tflops = c.flops / c.us / 1e6
        c.mma_peak_frac = c.tflops * 1e12 / datasheet_of(ceilings).mma_flops_per_s[c.floor_peak]
        for key, value in ceiling_ratios(c.us, ceilings, experts_hit=c.active_experts, pairs=c.pairs, hidden=hidden,
                                         intermediate=inter, weight_fmt=wfmt).items():
            setattr(c, key, value)


def peer_ratios(r, cases: list[Case], ceilings: dict, active: int, hidden: int, inter: int) -> None:
    """A peer's figure against the run's ceilings (ceiling_ratios; x_floor_measured: the A8W4 floor at the
    measured ceilings) and the project's figures of the same routing (``<scheme>_over_peer`` = project
    µs / peer µs: below 1, the project is faster; ``naive_torch_over_peer`` likewise;
    ``<scheme>_over_peer_gemms``: over the peer's two GEMMs alone, where its API times them, stages_us)."""
    if not r.usable():
        return
    stages = [r.stages_us.get(k) for k in ("gemm1", "gemm2")]
    gemms_us = sum(stages) if all(isinstance(v, float) and v == v for v in stages) else None
    r.ratios.update(ceiling_ratios(r.us, ceilings, experts_hit=active, pairs=r.pairs, hidden=hidden, intermediate=inter))
    floor = case_floors(ceilings, experts_hit=active, pairs=r.pairs, hidden=hidden, intermediate=inter,
                        weight_fmt="mxfp4", a_fmt="fp8")["floor_measured_us"]
    r.ratios["x_floor_measured"] = r.us / floor
    for c in cases:
        if (c.experts, c.tokens) == (r.experts, r.tokens) and not c.error and c.us == c.us:
            name = "naive_torch" if c.provider == "torch_grouped_mm" else (c.scheme if c.provider == "triton" else f"{c.provider}_{c.scheme}")
            r.ratios[f"{name}_over_peer"] = c.us / r.us
            if gemms_us and name != "naive_torch":
                r.ratios[f"{name}_over_peer_gemms"] = c.us / gemms_us


def forward_call(prov, a, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath, out_fmt: str):
    """One experts forward returning ``out_fmt``: fp32 rows (forward) or combine wire rows (forward_wire)."""
    if out_fmt == "fp32":
        return lambda: prov.forward(a, pairs, weights, math)
    wire = combine_wire(out_fmt)
    return lambda: prov.forward_wire(a, pairs, weights, math, wire)


def run_case(c: Case, fn, check) -> Case:
    try:
        y = fn()
        c.rel_l2_fp32, c.rel_l2_ref, c.rel_l2_tokens = check(y)
        del y
        call, c.graph = graph_or_eager(fn)  # one capture serves both timings
        with ClockSampler(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")) as clock:
            c.us, _ = time_fn(call, use_graph=False)
        c.clock = clock.stats()
        if c.graph:  # the same forward near full clock, beside the power-capped sustained figure
            c.us_isolated = statistics.median(time_isolated(call, 7, idle_s=0.05))
    except Exception as exc:  # noqa: BLE001 - one failing variant must not sink the whole sweep
        c.error = f"{type(exc).__name__}: {str(exc)[:400]}"
        print(f"  FAILED {c.provider} {c.scheme} E{c.experts} T{c.tokens} {c.config}: {c.error}", file=sys.stderr)
    return c


def run(args: argparse.Namespace) -> int:
    from megamoe_backend.experts.triton.provider import STORAGE_OF, TritonExperts
    from megamoe_backend.experts.triton.quant import quantize_rows

    if args.replot:
        return replot(args.replot, args.plot)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not interpreting():
        print("bench experts needs a CUDA GPU (or TRITON_INTERPRET=1 for a CPU smoke run)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    limit = args.swiglu_limit if args.swiglu_limit and args.swiglu_limit > 0 else None
    hidden, inter, topk = args.hidden, args.intermediate, args.topk
    t_start = time.time()
    meta = environment(args)
    meta["ceilings"] = {**datasheet_ceilings(device), **measure_ceilings(device)}
    meta["floor"] = FLOOR_META
    print(json.dumps({k: v for k, v in meta["ceilings"].items() if not k.endswith("_clock")}))
    cases: list[Case] = []
    variants: list[Case] = []
    peer_results: list[peer_bench.PeerResult] = []
    ready_peers = []
    if args.peers is not None:
        ready_peers, skipped = peer_bench.select(args.peers, args.peer_tune_cache)
        meta["peers"] = peer_bench.describe(ready_peers, skipped)
    meta["not_run"] = []  # (experts, tokens) groups left out by --budget-s
    max_e = max(args.experts)
    fp4_all, bf16_all = make_weights(max_e, hidden, inter, device, args.seed)
    blk_all, blk_deq_all = make_block_fp8_weights(bf16_all) if "fp8_block" in args.schemes else (None, None)
    block_peer = None  # vLLM's Triton block-FP8 fused_experts beside --schemes fp8_block (peer_vllm_block_fp8.py)
    if blk_all is not None and not args.no_block_fp8_peer:
        from . import peer_vllm_block_fp8 as block_peer

        meta["block_fp8_peer"] = {"peer": block_peer.NAME, "skipped": block_peer.why_not()}
    # the layer calls prepare_weights once per layer with its math: "auto" re-lays MXFP4 weights as FP8
    # fragments (frag8) for MX activations and as bf16 fragments (frag) for bf16 activations
    by_kind = {}  # storage -> prepared weights (one copy each)

    def prepared(decoder: str, math: ExpertMath) -> ExpertWeights:
        want = STORAGE_OF.get(decoder)
        if want in by_kind:
            return by_kind[want]
        w = TritonExperts(decoder=decoder).prepare_weights(fp4_all, math) if decoder in ("auto", "frag", "frag8") else fp4_all
        return by_kind.setdefault(w.storage, w)

    mx_math, bf16_math = ExpertMath("a8w4", limit), ExpertMath("bf16", limit)
    humming = {}  # (experts, weights fmt) -> (HummingExperts, its prepared weights): the layout fixes the expert count

    def humming_for(n_exp: int, fmt: str = "mxfp4"):
        from megamoe_backend.experts.humming.provider import HummingExperts

        if (n_exp, fmt) not in humming:
            prov = HummingExperts()
            src, math = (fp4_all, mx_math) if fmt == "mxfp4" else (blk_all, ExpertMath("fp8_block", limit))
            humming[(n_exp, fmt)] = (prov, prov.prepare_weights(slice_weights(src, n_exp), math))
            key = str(n_exp) if fmt == "mxfp4" else f"{n_exp} {fmt}"
            meta.setdefault("humming", {})[key] = {**prov.jit_report, "version": prov.library.version()}
        return humming[(n_exp, fmt)]

    fp4_prepared = {True: prepared(args.decoder, mx_math), False: prepared(args.decoder if args.decoder != "frag8" else "split", bf16_math)}
    if args.variants:  # the other fragment decoder, measured beside the default (docs/triton.md)
        for d in ("frag", "frag8"):
            prepared(d, mx_math)
    torch.cuda.synchronize() if device.type == "cuda" else None
    print(f"weights ready ({time.time() - t_start:.1f}s)")
    for n_exp in args.experts:
        fp4 = slice_weights(fp4_all, n_exp)
        fp4_prep = {mx: slice_weights(w, n_exp) for mx, w in fp4_prepared.items()}
        kinds = {st: slice_weights(w, n_exp) for st, w in by_kind.items()}
        bf16 = slice_weights(bf16_all, n_exp)
        for tokens in args.tokens:
            if args.budget_s is not None and time.time() - t_start > args.budget_s:
                meta["not_run"].append({"experts": n_exp, "tokens": tokens})
                print(f"  --budget-s {args.budget_s:.0f} spent: E{n_exp} T{tokens} not run", file=sys.stderr)
                continue
            x, pairs = make_routing(tokens, n_exp, topk, hidden, device, args.seed + tokens)
            p = len(pairs)
            active = experts_hit(pairs.slot)
            sel = check_subset(pairs, args.check_pairs, args.seed)
            tokens_check = TokenCheck(x, pairs, bf16, limit, check_tokens(tokens, peer_bench.CHECK_TOKENS, args.seed, device))
            refs = {}

            def checker(math: ExpertMath, out_fmt: str, wd=bf16, tc=tokens_check):
                def check(y):
                    key = (math.quant,)
                    if key not in refs:
                        refs[key] = (subset_reference(x, pairs, sel, wd, math, exact=False),
                                     subset_reference(x, pairs, sel, wd, math, exact=True))
                    r32, rex = refs[key]
                    ys = output_values(y[sel], out_fmt, hidden)
                    if out_fmt != "fp32":  # the exact result in the same output format: relL2 ref stays the kernels' error
                        rex = output_values(combine_wire(out_fmt).encode(rex), out_fmt, hidden)
                    return rel_l2(ys, r32), rel_l2(ys, rex), tc.of_pairs(y, out_fmt)
                return check

            for scheme in args.schemes:
                quant, wfmt = SCHEMES[scheme]
                if scheme == "fp8_block":  # block-FP8 weights of the same values, one decoder (block_fp8)
                    blk, blk_deq = slice_weights(blk_all, n_exp), slice_namespace(blk_deq_all, n_exp)
                    math = ExpertMath(quant, limit)
                    a = quantize_rows(x, math.a_format, name="bench tokens")
                    prov = TritonExperts(capacity=p)
                    mode = prov.resolve_decoder(wfmt)
                    c = Case(n_exp, tokens, p, scheme, "triton", mode, describe(default_config(p, n_exp, mode)),
                             out=args.combine_wire, active_experts=active)
                    tc = TokenCheck(x, pairs, blk_deq, limit, tokens_check.tokens)
                    run_case(c, forward_call(prov, a, pairs, blk, math, args.combine_wire),
                             checker(math, args.combine_wire, blk_deq, tc))
                    fill_metrics(c, hidden, inter, wfmt, math.a_format, meta["ceilings"])
                    cases.append(c)
                    print_case(c)
                    save(args.json, meta, cases, variants)
                    if args.humming:  # humming's block-scaled GEMMs on the same weights (experts/humming/)
                        c = Case(n_exp, tokens, p, scheme, "humming", "humming", "humming-kernels indexed, 128x128 blocks",
                                 out=args.combine_wire, active_experts=active)
                        try:
                            hprov, hweights = humming_for(n_exp, "fp8_block")
                            run_case(c, forward_call(hprov, a, pairs, hweights, math, args.combine_wire),
                                     checker(math, args.combine_wire, blk_deq, tc))
                        except Exception as exc:  # noqa: BLE001 - a missing humming must not sink the sweep
                            c.error = f"{type(exc).__name__}: {str(exc)[:400]}"
                        fill_metrics(c, hidden, inter, wfmt, math.a_format, meta["ceilings"])
                        cases.append(c)
                        print_case(c)
                        save(args.json, meta, cases, variants)
                    ids, route_w = pairs.slot.view(tokens, topk), pairs.weight.view(tokens, topk)
                    if block_peer is not None:
                        peer_results.append(block_peer.run(blk, x, ids, route_w, limit, tc.of_tokens))
                    block_peers = [peer for peer in ready_peers if peer.weights_fmt == "fp8_block"]
                    if block_peers:
                        shape = peer_bench.PeerShape(hidden, inter, topk, limit)
                        peer_results += peer_bench.run_peers(block_peers, blk, shape, x, ids, route_w, tc.of_tokens,
                                                             max_tokens=max(args.tokens))
                    save(args.json, meta, cases, variants, peer_results)
                    continue
                math = ExpertMath(quant, limit)
                a_fmt = math.a_format
                a = x if a_fmt is None else quantize_rows(x, a_fmt, name="bench tokens")
                wire_out = args.combine_wire
                configs = [(args.decoder, None, wire_out)]
                if args.variants and scheme == "a8w4" and n_exp == args.experts[0]:
                    configs += [(args.decoder, None, o) for o in OUTPUTS if o != wire_out]
                    configs += [(args.decoder, v, wire_out) for v in VARIANTS[bucket_class(p, n_exp)]]
                    default_mode = TritonExperts(decoder=args.decoder).resolve_decoder(wfmt, fp4_prep[True].storage)
                    configs += [(d, None, wire_out) for d in ("frag", "frag8") if d != default_mode]
                    configs += [("split", None, wire_out), ("dot_scaled", None, wire_out)]
                for i, (decoder, cfg, out_fmt) in enumerate(configs):
                    prov = TritonExperts(capacity=p, decoder=decoder, config=cfg, gemm=args.gemm if i == 0 else "triton")
                    if wfmt == "bf16":
                        weights = bf16
                    elif decoder == args.decoder:
                        weights = fp4_prep[a_fmt is not None]
                    else:
                        weights = kinds.get(STORAGE_OF.get(decoder, "rowmajor"), fp4)
                    mode = prov.resolve_decoder(wfmt, weights.storage)
                    used = cfg or default_config(p, n_exp, mode)
                    c = Case(n_exp, tokens, p, scheme, "triton", mode, describe(used), out=out_fmt,
                             active_experts=active)
                    run_case(c, forward_call(prov, a, pairs, weights, math, out_fmt), checker(math, out_fmt))
                    fill_metrics(c, hidden, inter, wfmt, a_fmt, meta["ceilings"])
                    (cases if i == 0 else variants).append(c)
                    print_case(c)
                    save(args.json, meta, cases, variants)
                if args.humming and scheme == "a8w4":  # the bench hook of experts/humming/ (its GPU test names it)
                    c = Case(n_exp, tokens, p, scheme, "humming", "humming", "humming-kernels indexed", out=wire_out,
                             active_experts=active)
                    try:
                        hprov, hweights = humming_for(n_exp)
                        run_case(c, forward_call(hprov, a, pairs, hweights, math, wire_out), checker(math, wire_out))
                    except Exception as exc:  # noqa: BLE001 - a missing humming must not sink the Triton sweep
                        c.error = f"{type(exc).__name__}: {str(exc)[:400]}"
                    fill_metrics(c, hidden, inter, wfmt, a_fmt, meta["ceilings"])
                    cases.append(c)
                    print_case(c)
                    save(args.json, meta, cases, variants)
            if not args.no_baseline and device.type == "cuda" and hasattr(torch, "_grouped_mm"):
                math = ExpertMath("bf16", limit)
                c = Case(n_exp, tokens, p, "bf16", "torch_grouped_mm", out=args.combine_wire, active_experts=active)
                run_case(c, lambda: grouped_mm_forward(x, pairs, bf16, limit, args.combine_wire),
                         checker(math, args.combine_wire))
                fill_metrics(c, hidden, inter, "bf16", None, meta["ceilings"])
                cases.append(c)
                print_case(c)
                save(args.json, meta, cases, variants)
            mxfp4_peers = [peer for peer in ready_peers if peer.weights_fmt == "mxfp4"]
            if mxfp4_peers:
                shape = peer_bench.PeerShape(hidden, inter, topk, limit)
                ids, route_w = pairs.slot.view(tokens, topk), pairs.weight.view(tokens, topk)
                for r in peer_bench.run_peers(mxfp4_peers, fp4, shape, x, ids, route_w, tokens_check.of_tokens,
                                              max_tokens=max(args.tokens)):
                    peer_ratios(r, cases, meta["ceilings"], active, hidden, inter)
                    peer_results.append(r)
                save(args.json, meta, cases, variants, peer_results)
            del x, pairs, tokens_check
    meta["wall_s"] = round(time.time() - t_start, 1)
    meta["complete"] = not meta["not_run"]
    print_table(cases, variants)
    print_peer_table(peer_results)
    save(args.json, meta, cases, variants, peer_results)
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        plot(cases, args.plot, peer_results)
    return 0


def save(path: str | None, meta: dict, cases: list[Case], variants: list[Case], peers: list | None = None) -> None:
    """(Re)write the JSON after every case, so a run cut short still leaves its numbers."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    result = {"meta": meta, "results": [asdict(c) for c in cases], "variants": [asdict(c) for c in variants],
              "peers": [asdict(r) for r in peers or []]}
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def slice_namespace(w, n: int):
    """slice_weights for make_block_fp8_weights' dequantised namespace."""
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(w), "w1": w.w1[:n], "w2": w.w2[:n], "num_experts": n})


def slice_weights(w: ExpertWeights, n: int) -> ExpertWeights:
    if w.num_experts == n:
        return w
    cut = lambda t: None if t is None else t[:n]  # noqa: E731 - leading-dim slices stay contiguous
    return ExpertWeights(cut(w.w1), cut(w.w2), w.fmt, w.gate_up_layout, cut(w.w1_scale), cut(w.w2_scale), w.storage,
                         cut(w.w1_row_scale), cut(w.w2_row_scale))


def command_line(module: str = __name__) -> str:
    prog = os.path.basename(sys.argv[0]) if sys.argv else ""
    head = "megamoe" if prog == "megamoe" else f"python -m {module}"
    return " ".join([head] + sys.argv[1:])


def card_name(meta: dict) -> str:
    """The GPU a run's JSON was made on, for a plot's title (``environment``'s ``gpu``; "no GPU" where a run had
    none). Why not a fixed name: an H100 run once drew "on one H200" over its figures."""
    return (meta.get("gpu") or {}).get("name", "no GPU")


def environment(args: argparse.Namespace, module: str = __name__) -> dict:
    """Versions, GPU, command and commit of a bench run (``module``: the bench that ran)."""
    import triton

    meta = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(module),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "shape": {"hidden": args.hidden, "intermediate": args.intermediate, "topk": args.topk},
    }
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        meta["git_commit"] = rev.stdout.strip() if rev.returncode == 0 else ""
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=5)
        meta["git_dirty"] = bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except Exception:  # noqa: BLE001 - not a git checkout (e.g. a copied tree)
        meta["git_commit"] = ""
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        meta["gpu"] = {"name": p.name, "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
                       "capability": f"{p.major}.{p.minor}"}
        try:
            meta["gpu"]["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                                   capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001
            pass
    return meta


def print_case(c: Case) -> None:
    print(f"  {c.provider:16s} {c.scheme:5s} E{c.experts:<4d} T{c.tokens:<5d} {c.decoder:10s} {c.config:28s} {c.out:5.5s} "
          f"{c.us:10.1f}us x{c.x_floor:5.2f} of {floor_text(c)} "
          f"(isolated {c.us_isolated:.0f}us x{c.x_floor_isolated:.2f}) {c.hbm_tbs:5.2f}TB/s {c.tflops:6.1f}TF "
          f"({c.mma_peak_frac:.0%} {c.floor_peak}) relL2 {c.rel_l2_fp32:.4f}/{c.rel_l2_ref:.2e}"
          f" SM {clock_text(c.clock)}"
          + (f" ERR {c.error[:80]}" if c.error else ""), flush=True)


def floor_text(c) -> str:
    """'3281.6 fp8' / '1403.8 hbm': a case's floor and what sets it (the weights, or the FP8 / bf16
    MMA); any case with floor_us / floor_bound / floor_peak (bench experts' and bench layer's)."""
    return f"{c.floor_us:.1f} {'hbm' if c.floor_bound == 'hbm' else c.floor_peak}"


def clock_text(clock: dict) -> str:
    """'1665 (1545)' = median (min) SM MHz while timed; '*' = some samples were slowed for power."""
    if not clock:
        return "-"
    return f"{clock['sm_mhz_median']:.0f} ({clock['sm_mhz_min']})" + ("*" if clock["power_capped_frac"] else "")


def print_table(cases: list[Case], variants: list[Case]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is a core dependency; keep the bench usable without it anyway
        for c in cases + variants:
            print_case(c)
        return
    for title, rows in (("experts forward (1 GPU)", cases), ("variants", variants)):
        if not rows:
            continue
        t = Table(title=title)
        for col in ("E", "T", "scheme", "provider", "config", "out", "µs", "floor µs (bound)", "x floor", "x measured",
                    "µs isolated", "x floor isolated", "TB/s", "TFLOP/s", "relL2 fp32", "relL2 ref", "graph",
                    "SM MHz (min)"):
            t.add_column(col, justify="right")
        for c in rows:
            t.add_row(str(c.experts), str(c.tokens), c.scheme, c.provider + (f"/{c.decoder}" if c.decoder else ""),
                      c.config, c.out, f"{c.us:.1f}", floor_text(c), f"{c.x_floor:.2f}", f"{c.x_floor_measured:.2f}",
                      f"{c.us_isolated:.1f}",
                      f"{c.x_floor_isolated:.2f}", f"{c.hbm_tbs:.2f}",
                      f"{c.tflops:.1f}", f"{c.rel_l2_fp32:.4f}", f"{c.rel_l2_ref:.1e}", "y" if c.graph else "n",
                      clock_text(c.clock))
        Console(width=220).print(t)


def print_peer_table(results: list) -> None:
    """The peers of the run beside the project's figures of the same routing (peer_ratios)."""
    if not results:
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="peers, same run, same routing (whole MoE call; project / peer < 1: the project is faster)")
    for col in ("E", "T", "peer", "µs", "µs isolated", "relL2", "a8w4 / peer", "a4w4 / peer", "naive / peer",
                "a8w4 / peer GEMMs", "x copy", "x FP8 GEMM", "graph", "first call s", "tactic", "error"):
        t.add_column(col, justify="right")
    for r in results:
        q = r.ratios
        t.add_row(str(r.experts), str(r.tokens), r.peer, f"{r.us:.1f}", f"{r.us_isolated:.1f}", f"{r.relL2:.4f}",
                  f"{q.get('a8w4_over_peer', float('nan')):.3f}", f"{q.get('a4w4_over_peer', float('nan')):.3f}",
                  f"{q.get('naive_torch_over_peer', float('nan')):.3f}", f"{q.get('a8w4_over_peer_gemms', float('nan')):.3f}",
                  f"{q.get('x_copy_measured', float('nan')):.2f}",
                  f"{q.get('x_fp8_gemm_measured', float('nan')):.2f}", "y" if r.graph else "n", f"{r.first_call_s:.1f}",
                  r.tactic[:40], (r.error or (f"UNTUNED: {r.untuned}" if r.untuned else ""))[:60])
    Console(width=220).print(t)


def replot(path: str, target: str | None) -> int:
    """Draw the PNG of a saved JSON (no GPU): the cases and the peers it holds."""
    with open(path) as f:
        saved = json.load(f)
    cases = [Case(**{k: v for k, v in c.items() if k in Case.__dataclass_fields__}) for c in saved["results"]]
    fields = peer_bench.PeerResult.__dataclass_fields__
    peers = [peer_bench.PeerResult(**{k: v for k, v in r.items() if k in fields}) for r in saved.get("peers", [])]
    plot(cases, target or path.replace(".json", ".png"), peers)
    return 0


def plot(cases: list[Case], path: str, peers: list | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return
    exps = sorted({c.experts for c in cases}, reverse=True)
    fig, axes = plt.subplots(1, len(exps), figsize=(6 * len(exps), 4.5), squeeze=False)
    for ax, e in zip(axes[0], exps):
        rows = [c for c in cases if c.experts == e and not c.error]
        for key in sorted({(c.provider, c.scheme) for c in rows}):
            pts = sorted((c.tokens, c.us) for c in rows if (c.provider, c.scheme) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[1]} ({key[0]})")
        ok_peers = [r for r in peers or [] if r.experts == e and r.usable()]
        for name in sorted({r.peer for r in ok_peers}):
            pts = sorted((r.tokens, r.us) for r in ok_peers if r.peer == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="--", marker="^", label=f"{name} (peer, whole MoE)")
        fl = sorted({(c.tokens, c.floor_us) for c in rows if c.scheme == "a8w4" and c.provider == "triton"})
        if fl:
            ax.plot([p[0] for p in fl], [p[1] for p in fl], "k--", label="A8W4 floor (MXFP4 bytes / FP8 MMA)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank (x top-k pairs)")
        ax.set_ylabel("µs per experts forward")
        ax.set_title(f"{e} local experts")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megamoe bench experts", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
