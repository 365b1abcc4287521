"""``--moe-backend megamoe_ep`` served by the real vLLM 0.34 on a GPU, against vLLM's default MoE backend.

Two halves, one set of checks (``gpu_engine_checks.py``):

- On a CUDA machine with vLLM 0.34 importable (the device, with ../shared/engine-gpu's bundle:
  docs/vllm.md, "On a GPU"), ``test_matrix_on_this_gpu`` runs the whole matrix (tiny DeepSeek-V3
  checkpoints: bf16, A8W4 on the fp8 wire, A4W4 on the fp4 wire; eager, FULL_DECODE_ONLY graphs,
  breakable graphs; both backends) and judges it. Elsewhere it is skipped, saying why.
- On any machine, ``test_recorded_gpu_run`` judges the committed record of such a run
  (benchmarks/results/gpu_engine_*.json), and ``test_checks_fail_on_planted_mutations`` shows each
  kind of check fails when the record is planted with what a broken backend would produce.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from gpu_engine_checks import (MATRIX, block_fp8_verdicts, dp_matches_ep1, humming_verdicts, peer_kill_ended,  # noqa: E402
                               pending_of, verdicts)

RECORD = ROOT / "benchmarks" / "results" / "gpu_engine_h100.json"
DP_RECORD = ROOT / "benchmarks" / "results" / "gpu_engine_dp_h100.json"
KILL_RECORD = ROOT / "benchmarks" / "results" / "gpu_engine_kill_h100.json"
HUMMING_RECORD = ROOT / "benchmarks" / "results" / "gpu_engine_humming_h100.json"
BLOCK_FP8_RECORD = ROOT / "benchmarks" / "results" / "gpu_engine_block_fp8_h100.json"


def _gpu_engine_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU with vLLM 0.34 (the device bundle, docs/vllm.md 'On a GPU'); the recorded run is checked instead"
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vLLM is not importable here (on the device: . .engine-gpu/setup_device.sh .engine-gpu)"
    return None


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The tiny checkpoints the record was made on (tiny_model.py is deterministic in its seed)."""
    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    from run_matrix import build_models

    return build_models(tmp_path_factory.mktemp("gpu-engine-models"), {"bf16", "twin", "a8w4", "a4w4", "fp8"})


def _assert_all(results):
    for label, ok, line in results:
        print(f"{'ok  ' if ok else 'FAIL'}  {label}: {line}")
    failed = [(label, line) for label, ok, line in results if not ok]
    assert not failed, failed


@pytest.mark.skipif(_gpu_engine_skip_reason() is not None, reason=str(_gpu_engine_skip_reason()))
@pytest.mark.timeout(1500)
def test_matrix_on_this_gpu(tmp_path, model_dirs):
    out = tmp_path / "gpu_engine.json"
    runs = [f"{name}={spec}" for name, spec in MATRIX.items()]
    subprocess.run([sys.executable, str(HERE / "run_matrix.py"), "--out", str(out), "--deadline-s", "1400",
                    "--models", str(tmp_path / "models"), *runs], check=True, env=dict(os.environ))
    record = json.loads(out.read_text())
    assert not pending_of(record)  # a fresh run judges every run of the matrix
    _assert_all(verdicts(record, model_dirs))


def test_recorded_gpu_run(model_dirs):
    record = json.loads(RECORD.read_text())
    for name, why in pending_of(record).items():
        assert name in record["runs"] and why, name  # a pending run is named, with its reason
        print(f"pending {name}: {why}")
    assert set(MATRIX) <= set(record["runs"])
    _assert_all(verdicts(record, model_dirs))


def _planted(record: dict, run: str, edit) -> dict:
    planted = copy.deepcopy(record)
    edit(planted["runs"][run])
    return planted


@pytest.mark.parametrize("mutation", ["logprobs-shifted", "greedy-third-token", "startup-eager", "never-captured",
                                      "no-layer-calls"])
def test_checks_fail_on_planted_mutations(model_dirs, mutation):
    record = json.loads(RECORD.read_text())

    def shift(rec):  # a MoE error twice the bound's size on every position
        rec["result"]["forced"] = [[x - 0.5 for x in seq] for seq in rec["result"]["forced"]]

    def third_token(rec):  # a greedy step that is neither run's runner-up
        rec["result"]["tokens"][0][0] = 3

    def startup_eager(rec):
        rec["startup_lines"] = [line.replace("graphs=captured", "graphs=eager") for line in rec["startup_lines"]]

    def never_captured(rec):
        rec["result"]["op_calls"]["captured"] = 0

    def no_calls(rec):
        rec["result"]["rhos"] = {}

    run, edit = {"logprobs-shifted": ("mega-a8w4-eager", shift), "greedy-third-token": ("mega-bf16-fdo", third_token),
                 "startup-eager": ("mega-bf16-fdo", startup_eager), "never-captured": ("mega-bf16-brk", never_captured),
                 "no-layer-calls": ("mega-bf16-eager", no_calls)}[mutation]
    results = verdicts(_planted(record, run, edit), model_dirs)
    assert not all(ok for _, ok, _ in results), f"the planted {mutation} passed every check"


def test_recorded_dp_ranks_equal_ep1():
    _assert_all(dp_matches_ep1(json.loads(DP_RECORD.read_text())))


@pytest.mark.parametrize("mutation", ["one-ulp", "token", "nccl", "no-idle"])
def test_dp_checks_fail_on_planted_mutations(mutation):
    record = json.loads(DP_RECORD.read_text())
    mode = record["modes"]["full_decode_only"]
    rank1 = mode["ranks"][1]["results"]["1"]
    if mutation == "one-ulp":  # the smallest difference a wrong EP sum could make
        rank1["forced"][0][5] = float(__import__("numpy").nextafter(rank1["forced"][0][5], 0.0))
    elif mutation == "token":
        rank1["tokens"][0][1] += 1
    elif mutation == "nccl":
        mode["startup_lines"][0] = [x.replace("p2p over ipc", "nccl") for x in mode["startup_lines"][0]]
    else:
        rank1["tokens"] = [t + [0] * 9 for t in rank1["tokens"]]
    assert not all(ok for _, ok, _ in dp_matches_ep1(record)), f"the planted {mutation} passed every check"


def test_recorded_peer_kill_ends_the_survivor():
    _assert_all(peer_kill_ended(json.loads(KILL_RECORD.read_text())))


@pytest.mark.parametrize("mutation", ["kept-serving", "clean-exit", "silent", "too-late", "not-ready"])
def test_kill_checks_fail_on_planted_mutations(mutation):
    record = json.loads(KILL_RECORD.read_text())
    survivor = record["survivors"]["0"]
    if mutation == "kept-serving":  # the launcher had to kill it at the bound
        survivor["ended_after_s"] = None
        survivor["cause_lines"].append('SURVIVED_LOOP {"rank": 0, "rounds": 40}')
    elif mutation == "clean-exit":
        survivor["rc"] = 0
    elif mutation == "silent":  # ended, but nothing says the peer was lost
        survivor["cause_lines"] = [x for x in survivor["cause_lines"] if "peer" not in x and "exit status" not in x]
    elif mutation == "too-late":
        survivor["ended_after_s"] = record["bound_s"] + 1
    else:
        record["ready_before_kill"] = False
    assert not all(ok for _, ok, _ in peer_kill_ended(record)), f"the planted {mutation} passed every check"


def test_recorded_humming_runs_inside_the_engine(model_dirs):
    """humming-kernels' GEMMs served inside vLLM on the GPU: named (eager) and picked by auto (FULL decode graphs)."""
    _assert_all(humming_verdicts(json.loads(HUMMING_RECORD.read_text()), model_dirs))


@pytest.mark.parametrize("mutation", ["auto-kept-triton", "logprobs-shifted"])
def test_humming_checks_fail_on_planted_mutations(model_dirs, mutation):
    record = json.loads(HUMMING_RECORD.read_text())
    rec = record["runs"]["hum-a8w4-fdo"]
    if mutation == "auto-kept-triton":
        rec["startup_lines"] = [line.replace("experts_provider=humming", "experts_provider=triton")
                                for line in rec["startup_lines"]]
    else:
        rec["result"]["forced"] = [[x - 0.5 for x in seq] for seq in rec["result"]["forced"]]
    assert not all(ok for _, ok, _ in humming_verdicts(record, model_dirs))


def test_recorded_block_fp8_runs_inside_the_engine(model_dirs):
    """A block-FP8 (DeepSeek V3 / R1-style) checkpoint served by MegaMoE inside vLLM on the GPU, eager and under FULL
    decode graphs, within the fp8_block bound of vLLM's default backend on the bf16 twin."""
    _assert_all(block_fp8_verdicts(json.loads(BLOCK_FP8_RECORD.read_text()), model_dirs))


@pytest.mark.parametrize("mutation", ["not-block-fp8", "logprobs-shifted", "never-captured"])
def test_block_fp8_checks_fail_on_planted_mutations(model_dirs, mutation):
    record = json.loads(BLOCK_FP8_RECORD.read_text())
    rec = record["runs"]["mega-fp8-fdo"]
    if mutation == "not-block-fp8":
        rec["startup_lines"] = [line.replace("quant=fp8_block", "quant=bf16") for line in rec["startup_lines"]]
    elif mutation == "logprobs-shifted":
        rec["result"]["forced"] = [[x - 0.5 for x in seq] for seq in rec["result"]["forced"]]
    else:
        rec["result"]["op_calls"]["captured"] = 0
    assert not all(ok for _, ok, _ in block_fp8_verdicts(record, model_dirs))
