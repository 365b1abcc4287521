"""One rank's part of an EP run over a synthetic problem (shared by demo, tests, GPU checks)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..knobs import Knobs
from ..layer import MegaMoELayer
from ..plan import ExpertPlacement, build_plan
from ..experts import ExpertWeights
from .problem import Problem, ProblemConfig, local_weights, make_problem


@dataclass(frozen=True)
class EPCase:
    quant: str
    dispatch_wire: str
    combine_wire: str
    placement_owner: tuple[int, ...] | None = None  # physical -> rank (None: linear)
    placement_logical: tuple[int, ...] | None = None  # physical -> logical (EPLB replicas)
    device: str = "cpu"
    iters: int = 1
    idle_ranks: tuple[int, ...] = ()  # these ranks bring 0 tokens (idle DP ranks) but join every collective
    provider: str | None = None  # force an experts provider ("torch" | "triton"); None: selection decides
    transport: str = "auto"  # MEGA_DISPATCH


def run_ep_rank(
    rank: int,
    world_size: int,
    cfg: ProblemConfig,
    case: EPCase,
    problem: Problem | None = None,
    all_weights: ExpertWeights | None = None,
) -> dict:
    """Build the plan and layer for this rank, run its token shard, return output and timing."""
    device = rank_device(case.device, rank)
    problem = problem or make_problem(cfg).to(device)
    if case.placement_owner is not None:
        placement = ExpertPlacement.from_assignment(list(case.placement_owner), world_size, case.placement_logical)
    else:
        placement = None
    knobs = Knobs(dispatch_wire=case.dispatch_wire, combine_wire=case.combine_wire, transport=case.transport)
    device_type = "cpu" if device.type == "cpu" else "cuda"
    plan = build_plan(cfg.spec, knobs, rank, world_size, placement=placement, device_type=device_type, quant=case.quant)
    if case.provider is not None:
        plan = build_plan(cfg.spec, knobs, rank, world_size, placement=placement, quant=case.quant,
                          backends=(case.provider, plan.backends.transport))
    if placement is not None:
        # redundant physical experts: route each logical id to one of its replicas (round robin by token)
        problem_ids = _to_physical(problem.topk_ids.cpu(), placement).to(device)
    else:
        problem_ids = problem.topk_ids
    all_weights = all_weights or problem.expert_weights(case.quant)
    weights = local_weights(all_weights, plan.placement, rank).to(device)
    layer = MegaMoELayer(plan, weights, group=dist.group.WORLD if dist.is_initialized() else None, device=device)
    t = cfg.tokens_per_rank
    end = rank * t if rank in case.idle_ranks else (rank + 1) * t
    x = problem.x[rank * t : end].to(device)
    ids = problem_ids[rank * t : end].to(device)
    w = problem.topk_weights[rank * t : end].to(device)
    out = layer(x, ids, w)
    timings = []
    for _ in range(max(0, case.iters - 1)):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        out = layer(x, ids, w)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - start)
    line = plan.startup_line(layer.transport_name, experts=getattr(layer.provider, "name", None))
    return {"out": out.cpu(), "seconds": min(timings) if timings else None, "startup_line": line}


def rank_device(kind: str, rank: int) -> torch.device:
    """"cpu" -> cpu; "cuda" -> this rank's GPU (one process per GPU)."""
    return torch.device("cpu") if kind == "cpu" else torch.device(f"{kind}:{rank}")


def _to_physical(ids: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    replicas: dict[int, list[int]] = {}
    for p, logical in enumerate(placement.logical_of_physical):
        replicas.setdefault(logical, []).append(p)
    out = ids.clone()
    for idx in range(ids.numel()):
        logical = int(ids.view(-1)[idx])
        if logical >= 0:
            reps = replicas[logical]
            out.view(-1)[idx] = reps[(idx // ids.shape[1]) % len(reps)]
    return out


def run_ep_cases(rank: int, world_size: int, cfg: ProblemConfig, cases: list[EPCase]) -> list[dict]:
    """Several cases in one process group: process start-up (seconds on CPU) is paid once."""
    problem = make_problem(cfg).to(rank_device(cases[0].device, rank)) if cases else None
    weights_by_quant: dict[str, ExpertWeights] = {}
    results = []
    for case in cases:
        if case.quant not in weights_by_quant:
            weights_by_quant[case.quant] = problem.expert_weights(case.quant)
        results.append(run_ep_rank(rank, world_size, cfg, case, problem, weights_by_quant[case.quant]))
    return results
