"""vLLM's start-up of a megamoe_ep MoE layer on a CUDA host, run on CPU with the GPU-host facts
injected (tests/startup_facts.py): vLLM's own VllmConfig, distributed init (gloo, TP 2 + EP), its
FusedMoEFactory layer, weight loader and ``process_weights_after_loading`` — the plugin's whole
start-up — up to the layer's decision (layer/startup.py), for every MEGA_DISPATCH, topology,
handshake outcome and cudagraph mode of the table. ep_size 8 is covered by tests/core/test_startup.py
(the same decision without an engine: eight vLLM ranks do not fit this CI machine).

Mutation run once (2026-12-04): the capture check judged before ``resolve_ep_transport`` (the
placeholder transport, as the plugin did at 2377c6c) fails ``default`` (refused with "EP over
MEGA_DISPATCH=nccl (ep_size 2)", the issue's symptom) and ``handshake-fails`` (a refusal that does
not say the handshake failed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megamoe_backend.parallel.spawn import free_port, spawn_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from startup_facts import CASES, check_case  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.multiproc]


def _rank(rank, world, port):
    import os

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from layer_harness import MoECase, build_and_load, case_tensors, init_ranks, vllm_config
    from startup_facts import CASES, inject, outcome
    from vllm.config import CUDAGraphMode, set_current_vllm_config

    import megamoe_vllm
    from megamoe_vllm.routed_experts import process_knobs

    megamoe_vllm.register()
    os.environ["MEGA_DISPATCH_WIRE"] = "bf16"
    case = MoECase(hidden=128, inter=64, experts=8, topk=2, tokens=4)
    t = case_tensors(case)
    vcfg = vllm_config(world, "megamoe_ep")
    out = {}
    with set_current_vllm_config(vcfg):
        init_ranks(rank, world, port)
        for c in CASES if world > 1 else [c for c in CASES if c.name in ("default", "nccl")]:
            inject(c, rank, world)
            process_knobs.cache_clear()  # the plugin reads MEGA_* once per process; each case is a new start
            vcfg.compilation_config.static_forward_context.clear()  # each case builds the same layer again
            # vLLM's CPU platform captures nothing (mode NONE); a GPU keeps its default mode unless --enforce-eager
            vcfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE if c.graphs else CUDAGraphMode.NONE
            out[c.name] = outcome(lambda: build_and_load(case, t))
    return out


@pytest.fixture(scope="module")
def world2():
    return spawn_ranks(2, _rank, free_port(), timeout_s=600)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_rank_starts_or_refuses_naming_the_flag(world2, case):
    check_case(case, [r[case.name] for r in world2], "--enforce-eager")


def test_ep_size_1_starts_with_graphs_on():
    (got,) = spawn_ranks(1, _rank, free_port(), timeout_s=600)
    # ep_size 1: the device forward, nothing exchanged, so nccl with graphs on starts too
    assert got["default"]["transport"] == "nccl" and got["nccl"]["transport"] == "nccl", got
