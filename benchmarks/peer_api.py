"""What every benchmark peer shares: the Peer interface, its results and skips, and how a peer is timed.

Why apart from benchmarks/peers.py (the registry and the FlashInfer / triton_kernels peers): the peers in modules
of their own (peer_vllm_humming.py, peer_flashinfer_megamoe.py, peer_vllm_block_fp8.py) import these, and peers.py
imports them back by name to list them; with the interface here neither imports the other's module in a circle.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from megamoe_backend.experts import ExpertWeights

from .gpu_clock import ClockSampler
from .timing import graph_or_eager, time_fn, time_isolated

CHECK_TOKENS = 32  # tokens a peer's relL2 reads (all their pairs)


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here; the message is the reason the bench records."""


@dataclass(frozen=True)
class PeerShape:
    hidden: int
    intermediate: int
    topk: int
    swiglu_limit: float | None  # DeepSeek V4: 10.0


@dataclass
class Skipped:
    peer: str
    reason: str


@dataclass
class PeerResult:
    """One peer timed on one routing. ``relL2``: against the bench's fp32 reference, per token."""

    peer: str
    experts: int  # local experts the call holds
    tokens: int  # token rows passed in
    pairs: int  # (token, local expert) pairs it computes
    ep_size: int = 1
    ep_rank: int = 0
    us: float = float("nan")  # median of back-to-back replays (timing.time_fn), as the project's figures
    us_isolated: float = float("nan")  # median of single replays after the GPU idled
    relL2: float = float("nan")  # noqa: N815 - the JSON field the issues name
    relL2_scope: str = "tokens: route-weighted sum over each sampled token's pairs vs fp32 on the dequantised weights"  # noqa: N815
    version: str = ""
    config: str = ""
    tactic: str = ""
    scope: str = ""  # what the timed call contains
    graph: bool = False
    first_call_s: float = float("nan")  # first call of the bucket: FlashInfer's autotune / Triton's JIT
    stages_us: dict = field(default_factory=dict)  # FlashInfer: GEMM1 / GEMM2 alone (its GEMM profiler)
    ratios: dict = field(default_factory=dict)  # the bench's: to the run's ceilings, to the project's figures
    clock: dict = field(default_factory=dict)
    error: str = ""
    untuned: str = ""  # why ``us`` is not the peer's tuned figure (FlashInfer kept no winner: it fell back)

    def usable(self) -> bool:
        """Whether ``us`` stands for the peer in ratios, tables and plots: measured, no error, tuned."""
        return self.us == self.us and not self.error and not self.untuned


def smoke_parser(module: str) -> argparse.ArgumentParser:
    """The arguments of a peer's smoke run alone (``python -m benchmarks.<module> --out X.json``): DSV4-Pro expert
    shapes and one EP 8 rank's 48 experts by default, the token counts to time, the SwiGLU clamp."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 1024])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--swiglu-limit", type=float, default=10.0)
    return ap


# ------------------------------------------------------------------------------------ the peers
class Peer:
    """One peer: ``load`` the weights once per weight set, ``bind`` a call to one routing, ``warm`` it
    the way its users do, then the bench times the call (``time_peer``)."""

    name = ""
    version = ""
    config = ""
    scope = ""
    weights_fmt = "mxfp4"  # the ExpertWeights fmt ``load`` takes: the bench hands each peer its scheme's weights

    def __init__(self) -> None:
        self.loaded_key = None
        self.experts = 0
        self.ep_size, self.ep_rank = 1, 0

    def load(self, weights: ExpertWeights, shape: PeerShape, *, max_tokens: int, ep_size: int = 1,
             ep_rank: int = 0) -> None:
        raise NotImplementedError

    def bind(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """A no-argument callable running the peer's whole MoE on these tensors (kept alive by it)."""
        raise NotImplementedError

    def warm(self, call) -> torch.Tensor:
        """The first call, as the peer's users make it (autotune / JIT); returns its output."""
        return call()

    def tactic(self, tokens: int) -> str:
        return ""

    def untuned(self, tokens: int) -> str:
        """Why the call at ``tokens`` did not run the peer's tuned configuration ("" when it did)."""
        return ""

    def release(self) -> None:
        """Drop the converted weights (a later ``load`` makes them again): room on a smaller GPU."""
        self.loaded_key = None

    def stages_us(self, x: torch.Tensor) -> dict:
        return {}


def require_cuda(peer: str) -> torch.device:
    if not torch.cuda.is_available():
        raise PeerUnavailable(f"{peer}: no CUDA GPU here (torch.cuda.is_available() is False); "
                              "the peer runs on the GPU device only")
    return torch.device("cuda", torch.cuda.current_device())


def weights_key(w: ExpertWeights) -> tuple:
    """Which weight set a peer holds converted: the tensors' addresses and shapes (the benches keep every
    set they pass alive while it is in use, so an address names one set)."""
    return (w.w1.data_ptr(), tuple(w.w1.shape), w.w1_scale.data_ptr() if w.w1_scale is not None else 0, w.w1.device)


def describe(ready: list[Peer], skipped: list[Skipped]) -> dict:
    """What meta.peers records: each peer that ran (version, config, scope) and each skipped one's reason."""
    return {"ran": [{"peer": p.name, "version": p.version, "config": p.config, "scope": p.scope} for p in ready],
            "skipped": [{"peer": s.peer, "reason": s.reason} for s in skipped]}


# --------------------------------------------------------------------------------------- timing
def time_peer(peer: Peer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, check) -> PeerResult:
    """Time ``peer`` (loaded) on token rows ``x`` [T, H] bf16 routed by ``ids`` [T, k] (global ids) with
    route weights ``weights`` [T, k]: warm the way its users do, ``check(y)`` -> relL2 of its output
    [T, H], then CUDA-graph replays timed as the project's figures (timing.time_fn / time_isolated).
    A failure is recorded in ``error``, never raised: one peer must not sink the bench."""
    lo = peer.ep_rank * peer.experts
    pairs = int(((ids >= lo) & (ids < lo + peer.experts)).sum())
    r = PeerResult(peer.name, peer.experts, x.shape[0], pairs, peer.ep_size, peer.ep_rank, version=peer.version,
                   config=peer.config, scope=peer.scope)
    try:
        call = peer.bind(x, ids, weights)
        t0 = time.perf_counter()
        y = peer.warm(call)
        torch.cuda.synchronize() if x.is_cuda else None
        r.first_call_s = round(time.perf_counter() - t0, 2)
        r.relL2 = float(check(y))
        del y
        timed, r.graph = graph_or_eager(call)
        with ClockSampler(x.device) as clock:
            r.us, _ = time_fn(timed, use_graph=False)
        r.clock = clock.stats()
        if r.graph:
            r.us_isolated = statistics.median(time_isolated(timed, 7, idle_s=0.05))
        r.tactic = peer.tactic(x.shape[0])
        r.untuned = peer.untuned(x.shape[0])
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON
        r.error = f"{type(exc).__name__}: {str(exc)[:400]}"
        torch.cuda.synchronize() if x.is_cuda else None
    if not r.error:
        try:
            r.stages_us = peer.stages_us(x)
        except Exception as exc:  # noqa: BLE001 - the stage timings are extra: keep the whole-call figure
            r.stages_us = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(peer_line(r), flush=True)
    return r


def peer_line(r: PeerResult) -> str:
    ep = f" EP{r.ep_size} rank {r.ep_rank}" if r.ep_size > 1 else ""
    stages = " ".join(f"{k} {v:.1f}" for k, v in r.stages_us.items() if isinstance(v, float) and math.isfinite(v))
    return (f"  peer {r.peer:18s} E{r.experts:<4d} T{r.tokens:<6d}{ep} {r.us:10.1f}us (isolated {r.us_isolated:.0f}) "
            f"relL2 {r.relL2:.4f} {'graph' if r.graph else 'EAGER'} first call {r.first_call_s:.1f}s {r.tactic}"
            + (f" [{stages}]" if stages else "") + (f" ERR {r.error[:160]}" if r.error else "")
            + (f" UNTUNED: {r.untuned}" if r.untuned else ""))
