"""The command lines scripts/serve_vllm_*.sh and scripts/bench_vllm_serve.sh print (--dry-run) parse in
vLLM's own CLI (vllm_parse_argv.py: the installed `vllm` main with its dispatch replaced by a recorder)
into exactly the reference run; the random workload's lengths, drawn by vLLM's own sampler, are fixed;
the GSM8K command parses in lm_eval's CLI. The dry runs themselves (both engines, no engine needed):
tests/core/test_scripts_dry_run.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "core"))
from test_scripts_dry_run import run  # noqa: E402  (the dry-run helper: clean variables, this venv's megamoe)


def argv_of(script: str, **env: str) -> list[list[str]]:
    """Every command line a dry run prints, after the executable (serve: not its `env MEGA_*` line)."""
    proc = run(script, "--dry-run", **env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("env ")]
    return [shlex.split(line) for line in lines]


@pytest.fixture(scope="module")
def parsed(tmp_path_factory) -> dict:
    argvs = {}
    for name, script, env in (
        ("dsv4", "serve_vllm_dsv4_pro_ep.sh", {}),
        ("r1_ref", "serve_vllm_r1_mxfp4_ep.sh", {"PRESET": "reference", "WIRE": "fp4"}),
        ("r1_ref_r64", "serve_vllm_r1_mxfp4_ep.sh", {"PRESET": "reference", "EPLB": "r64"}),
        ("r1_ref_default", "serve_vllm_r1_mxfp4_ep.sh", {"PRESET": "reference", "BACKEND": "default"}),
        ("r1_nccl", "serve_vllm_r1_mxfp4_ep.sh", {"N": "4", "TRANSPORT": "nccl"}),
    ):
        (argv,) = argv_of(script, **env)
        assert argv[0] == "vllm"
        argvs[f"serve:{name}"] = argv[1:]
    for i, argv in enumerate(argv_of("bench_vllm_serve.sh", PRESET="reference", MODEL="/m")):
        argvs[f"bench:ref{i}"] = argv[1:]
    (share,) = argv_of("bench_vllm_serve.sh", PRESET="reference", DATASET="sharegpt", DATASET_PATH="/d/sg.json")
    argvs["bench:sharegpt"] = share[1:]
    tmp = tmp_path_factory.mktemp("vllm_argv")
    (tmp / "argv.json").write_text(json.dumps(argvs))
    proc = subprocess.run([sys.executable, str(HERE / "vllm_parse_argv.py"), str(tmp / "argv.json"), str(tmp / "out.json")],
                          capture_output=True, text=True, timeout=300, cwd=HERE,
                          env={**os.environ, "PYTHONPATH": str(HERE), "VLLM_TARGET_DEVICE": "cpu"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


def test_reference_serve_parses_into_the_reference_plan(parsed):
    for name in ("serve:r1_ref", "serve:r1_ref_r64", "serve:r1_ref_default"):
        assert parsed[name]["ok"], parsed[name]
    ref = parsed["serve:r1_ref"]["parsed"]
    assert {k: ref[k] for k in ("model", "data_parallel_size", "tensor_parallel_size", "enable_expert_parallel",
                                 "moe_backend", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
                                 "kv_cache_dtype", "block_size", "enable_prefix_caching", "enable_eplb",
                                 "enforce_eager")} == {
        "model": "amd/DeepSeek-R1-0528-MXFP4", "data_parallel_size": 8, "tensor_parallel_size": 1,
        "enable_expert_parallel": True, "moe_backend": "megamoe_ep", "max_model_len": 9472,
        "max_num_batched_tokens": 8192, "max_num_seqs": 512, "kv_cache_dtype": "fp8", "block_size": 16,
        "enable_prefix_caching": False, "enable_eplb": True, "enforce_eager": False}
    assert ref["eplb"] == {"num_redundant_experts": 0, "window_size": 200, "step_interval": 200}
    assert parsed["serve:r1_ref_r64"]["parsed"]["eplb"]["num_redundant_experts"] == 64
    default = parsed["serve:r1_ref_default"]["parsed"]
    assert default["moe_backend"] != "megamoe_ep"  # vLLM's own (its default value)
    assert {k: v for k, v in default.items() if k != "moe_backend"} == {k: v for k, v in ref.items() if k != "moe_backend"}


def test_default_serve_commands_parse(parsed):
    dsv4 = parsed["serve:dsv4"]
    assert dsv4["ok"], dsv4
    assert (dsv4["parsed"]["model"], dsv4["parsed"]["kv_cache_dtype"], dsv4["parsed"]["enable_eplb"]) == (
        "deepseek-ai/DeepSeek-V4-Pro", "fp8", False)
    nccl = parsed["serve:r1_nccl"]
    assert nccl["ok"] and nccl["parsed"]["enforce_eager"] is True and nccl["parsed"]["data_parallel_size"] == 4


def test_reference_bench_parses_with_fixed_lengths(parsed):
    points = []
    for name in ("bench:ref0", "bench:ref1"):
        r = parsed[name]
        assert r["ok"], r
        b = r["parsed"]
        assert (b["dataset_name"], b["random_input_len"], b["random_output_len"], b["ignore_eos"], b["seed"],
                b["request_rate"], b["num_warmups"], b["save_result"]) == ("random", 8192, 1024, True, 0, float("inf"), 64, True)
        # vLLM's own sampler draws every request at exactly ISL / OSL for the scripts' range ratio
        assert (b["sampled_input_lens"], b["sampled_output_lens"]) == ([8192], [1024])
        points.append((b["max_concurrency"], b["num_prompts"]))
    assert points == [(512, 5120), (4096, 8192)]
    share = parsed["bench:sharegpt"]
    assert share["ok"] and (share["parsed"]["dataset_name"], share["parsed"]["dataset_path"]) == ("sharegpt", "/d/sg.json")


def test_gsm8k_command_parses_in_lm_eval():
    pytest.importorskip("lm_eval._cli", reason="lm_eval's CLI (scripts/test.sh installs lm_eval==0.4.13 --no-deps)")
    from lm_eval._cli import HarnessCLI

    (argv,) = argv_of("bench_vllm_serve.sh", DATASET="gsm8k", MODEL="/models/V4", CONCURRENCY="32")
    old = sys.argv
    try:
        sys.argv = argv
        args = HarnessCLI().parse_args()
    finally:
        sys.argv = old
    assert (args.command, args.model, args.tasks, args.num_fewshot) == ("run", "local-completions", ["gsm8k"], 5)
    assert args.model_args == {"model": "/models/V4", "base_url": "http://127.0.0.1:8000/v1/completions",
                               "num_concurrent": 32, "max_retries": 3, "tokenized_requests": False}
