"""SGLang's own FusedMoE runs a forward through MegaMoE on CPU at world size 1 and 2 (gloo).

Each rank is a separate process that starts like an SGLang scheduler (load_plugins, server args,
publish, SGLang's distributed init with gloo), builds SGLang's FusedMoE with SGLang's quant method
(unquantised = DeepSeek V3/R1 bf16; Quark MXFP4 A4W4 = the R1 MXFP4 fixture's quantization_config),
loads DeepSeek-named checkpoint tensors through SGLang's weight loader (EP slicing included),
runs process_weights_after_loading, and calls FusedMoE.forward with a StandardTopKOutput.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_test_env import HERE, load_json

pytestmark = [pytest.mark.engine, pytest.mark.multiproc]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, tmp_path, scenario: str, env: dict | None = None, args: tuple[str, ...] = ()) -> list[dict]:
    import os

    port = _free_port()
    procs, outs = [], []
    for rank in range(world):
        out = tmp_path / f"{scenario}_w{world}_r{rank}.json"
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "sglang_worker.py"), scenario, str(rank), str(world), str(port), str(out),
             "--moe-a2a-backend", "megamoe_ep", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(env or {})},
        ))
    logs = [p.communicate(timeout=400)[0] for p in procs]
    results = []
    for out, log in zip(outs, logs):
        assert out.exists(), log[-4000:]
        r = load_json(out)
        assert r["ok"], r.get("error")
        pt = Path(str(out).replace(".json", ".pt"))
        r["out"] = torch.load(pt)["out"] if pt.exists() else None
        results.append(r)
    return results


SCENARIOS = {
    "bf16": ("forward_bf16", {}),
    "mxfp4": ("forward_mxfp4", {"MEGA_DISPATCH_WIRE": "fp4"}),  # A4W4: quantise once on the sender
}
# bf16: only output rounding. A4W4: fp4 activations vs an fp32 reference without activation quant,
# held to the project's A4W4 layer gate. Neither depends on the CPU: seeded inputs, and MegaMoE's CPU
# experts accumulate in float64 (the same bits on every machine; docs/vllm.md, "Numeric bounds").
REF_TOL = {"bf16": 1e-2, "mxfp4": 0.28}


@pytest.fixture(scope="module", params=["bf16", "mxfp4"])
def fmt(request):
    return request.param


@pytest.fixture(scope="module")
def world1(tmp_path_factory, fmt):
    scenario, env = SCENARIOS[fmt]
    return run_ranks(1, tmp_path_factory.mktemp(f"w1{fmt}"), scenario, env)


@pytest.fixture(scope="module")
def world2(tmp_path_factory, fmt):
    scenario, env = SCENARIOS[fmt]
    return run_ranks(2, tmp_path_factory.mktemp(f"w2{fmt}"), scenario, env)


def test_world1_runs_through_megamoe_and_matches_core(world1, fmt):
    (r,) = world1
    assert r["a2a_enum"] == "MoeA2ABackend.CUSTOMIZED" and r["is_megamoe_dispatcher"]
    assert (r["quant_method"], r["scheme"], r["plan_quant"], r["wire"]) == {
        "bf16": ("UnquantizedFusedMoEMethod", "NoneType", "bf16", "bf16"),
        "mxfp4": ("QuarkFusedMoEMethod", "QuarkW4A4MXFp4MoE", "a4w4", "fp4"),
    }[fmt]
    assert r["tensors_loaded"] == 3 * 8 * (1 if fmt == "bf16" else 2)  # weights (+ scales) of 8 experts
    assert r["sglang_params_released"]  # MegaMoE holds the only (converted) copy
    assert r["converted_copy_released"]  # ... and only the runtime's (prepared) one after the first forward
    assert r["out_shape"] == [5, 64] and r["out_dtype"] == "torch.bfloat16"
    assert r["equal_to_core_layer"], r["rel_l2_vs_core_layer"]
    assert r["rel_l2_vs_fp32_reference"] < REF_TOL[fmt]
    assert r["repeat_equal"]
    if fmt == "bf16":
        assert r["wire_mismatch_error"].startswith("KnobError: MEGA_DISPATCH_WIRE=fp4 does not match"), r["wire_mismatch_error"]


def test_world2_gloo_matches_core_and_world1(world1, world2, fmt):
    assert [r["ep_rank"] for r in world2] == [0, 1]
    assert all(r["num_local_experts"] == 4 for r in world2)
    assert all(r["transport"] != "local" for r in world2), [r["transport"] for r in world2]
    for r in world2:
        assert r["equal_to_core_layer"], r["rel_l2_vs_core_layer"]
        assert r["rel_l2_vs_fp32_reference"] < REF_TOL[fmt]
    # rank 0's tokens are the same at both sizes: the result does not depend on the EP size
    assert torch.equal(world2[0]["out"], world1[0]["out"])


def test_eplb_redundant_experts_and_sglangs_rebalance_over_gloo(tmp_path, model_dirs, fmt):
    """--enable-eplb --ep-num-redundant-experts 2 on 2 ranks (10 physical experts, 5 per rank): SGLang's
    placement, loader, dispatch map, rebalance and ExpertLocationUpdater (see sglang_worker.eplb_scenario);
    bit-identical to the run without redundancy before and after the experts moved (A4W4: scales too)."""
    scenario, env = SCENARIOS[fmt]
    ranks = run_ranks(2, tmp_path, f"eplb_{fmt}", {**env, "MEGAMOE_TEST_MODEL": str(model_dirs[8])},
                      # static: SGLang's choice under --enable-eplb with an a2a backend (resolution of a
                      # dummy model stops before that step, so it is given here)
                      ("--enable-eplb", "--ep-num-redundant-experts", "2", "--ep-dispatch-algorithm", "static"))
    for r in ranks:
        assert r["initial_map"] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]  # init_trivial: physical p holds logical p % 8
        assert "experts=10 logical=8 redundant/rank=0,2 " in r["startup_line"] and r["num_local_experts"] == 5
        # get_moe_weights() is exactly MegaMoE's tensors (contiguous, one row per local slot)
        assert all(shape[0] == 5 and contiguous for shape, contiguous, _ in r["moe_weights"])
        assert sorted(p for *_, p in r["moe_weights"]) == sorted(p for _, p in r["megamoe_tensors"].values())
        for tag in ("initial", "moved"):
            assert r[f"{tag}_physical_ids_valid"], tag  # SGLang's dispatch picked replicas of the routed experts
            assert r[f"{tag}_equal_to_core"], tag
            assert r[f"{tag}_sweep_equal_to_core"], tag  # every physical slot holds its logical expert's weights
            assert r[f"{tag}_rel_l2_vs_fp32_reference"] < REF_TOL[fmt], (tag, r[f"{tag}_rel_l2_vs_fp32_reference"])
        assert set(r["megamoe_tensors"]) == ({"w1", "w2"} if fmt == "bf16" else {"w1", "w2", "w1_scale", "w2_scale"})
    assert {8, 9} & set(ranks[1]["initial_physical_ids_used"])  # rank 1 routes logical 0, 1 to its replicas
    assert not {8, 9} & set(ranks[0]["initial_physical_ids_used"])  # rank 0 to its originals
    old, new = ranks[0]["initial_map"], ranks[0]["moved_map"]
    assert ranks[1]["moved_map"] == new and sorted(set(new)) == list(range(8))
    crossed = [p for p in range(10) if new[p] not in old[(p // 5) * 5:(p // 5 + 1) * 5]]
    assert crossed, (old, new)  # some expert came from the other rank


def test_dp_ranks_pass_the_same_token_bound_through_sglangs_dp_steps(tmp_path, model_dirs):
    """2 DP ranks through SGLang's own DP bookkeeping (sglang_worker.bound_scenario: the scheduler's
    prepare_mlp_sync_batch_raw with its idle batch, ForwardBatch.prepare_mlp_sync_batch's padding
    and publication), then FusedMoE.forward on each rank's padded batch: the real MegaMoELayer.forward
    (the torch forward over gloo, which checks the bound against both ranks' dispatch header)
    received and accepted the same bound on both ranks, in extend, decode, idle-rank and captured
    steps. The hook is what makes the counts global: without it SGLang keeps each rank's own count
    for a CUSTOMIZED a2a backend. What this is not: an SGLang server (its CPU engine needs
    sgl_kernel's CPU ops, not installable here), so no scheduler loop, model or graph runner runs."""
    ranks = run_ranks(2, tmp_path, "bound", {"MEGAMOE_TEST_MODEL": str(model_dirs[8])})
    # per step: each rank's batch mode, the gathered counts, SGLang's padding, the published counts,
    # each rank's MoE batch (its padded token count), the bound both ranks' layers must receive
    expected = [
        (("EXTEND", "EXTEND"), [3, 17], "SUM_LEN", [3, 17], (3, 17), 32),
        (("EXTEND", "IDLE"), [5, 0], "SUM_LEN", [5, 0], (5, 0), 8),  # rank 1: SGLang's idle batch, 0 tokens
        (("DECODE", "DECODE"), [2, 1], "MAX_LEN", [2, 2], (2, 2), 2),
        (("DECODE", "IDLE"), [3, 0], "MAX_LEN", [3, 3], (3, 3), 4),  # the idle batch padded to rank 0's 3
    ]
    for rank, r in enumerate(ranks):
        assert r["runtime_built_at_load"]  # before SGLang sizes its KV cache, not at the first forward
        assert r["require_mlp_tp_gather"] is True
        assert r["unhooked_gathered"] == [(3, 17)[rank]]
        assert r["steps"] == [{"mode": modes[rank], "gathered": gathered, "padding": padding, "published": published,
                               "moe_tokens": moe_tokens[rank]}
                              for modes, gathered, padding, published, moe_tokens, _ in expected], r["steps"]
        assert r["calls"] == [{"tokens": e[4][rank], "bound": e[5], "forward": "TorchForward"} for e in expected] + [
            {"tokens": 8, "bound": 8, "forward": "TorchForward"}], r["calls"]  # the captured batch of 8


# Block-FP8: two e4m3 roundings of the activations (A1 and A2, ~0.026 each) against fp32 on the dequantised
# weights, the layer gate of tests/core/test_block_fp8_layer.py (0.044-0.045 measured there).
BLOCK_FP8_GATE = 0.06


@pytest.mark.parametrize("world", [1, 2])
def test_block_fp8_checkpoint_through_sglangs_fp8_method(tmp_path, world):
    """DeepSeek V3 / R1 FP8 experts: SGLang's own Fp8Config (the fixture's quantization_config, weight_block_size
    [128, 128]) builds its Fp8MoEMethod, whose parameters SGLang's loader fills from per-expert e4m3 weights and
    fp32 weight_scale_inv; MegaMoE runs them bit for bit as the core layer does on the same tensors, at EP 1 and
    over gloo at EP 2. (vLLM's counterpart runs the whole engine: tests/vllm/test_engine.py.)"""
    ranks = run_ranks(world, tmp_path, "forward_block_fp8")
    assert [r["ep_rank"] for r in ranks] == list(range(world))
    for r in ranks:
        assert (r["quant_method"], r["plan_quant"], r["wire"]) == ("Fp8MoEMethod", "fp8_block", "bf16")
        assert "quant=fp8_block" in r["startup_line"], r["startup_line"]
        assert r["num_local_experts"] == 8 // world
        assert r["tensors_loaded"] == 3 * 2 * 8  # weight + weight_scale_inv of gate/up/down, 8 experts (EP skips none)
        assert r["sglang_params_released"]
        assert r["out_shape"] == [5 + r["ep_rank"], 256] and r["out_dtype"] == "torch.bfloat16"
        assert r["equal_to_core_layer"], r["rel_l2_vs_core_layer"]
        assert 1e-3 < r["rel_l2_vs_fp32_reference"] < BLOCK_FP8_GATE, r["rel_l2_vs_fp32_reference"]
