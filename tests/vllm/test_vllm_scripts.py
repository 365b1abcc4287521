"""Dry runs of the vLLM launch / bench scripts print exactly the flags DP-attention EP serving needs."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVE_SCRIPTS = ["scripts/serve_vllm_dsv4_pro_ep.sh", "scripts/serve_vllm_r1_mxfp4_ep.sh"]


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("WIRE", "DP", "MODEL", "PORT", "HOST") and not k.startswith("EPLB")}
    full_env.update(env)
    return subprocess.run(["bash", str(ROOT / script), *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", SERVE_SCRIPTS)
@pytest.mark.parametrize("wire", ["bf16", "fp8", "fp4"])
def test_serve_dry_run_prints_ep_command(script, wire):
    r = _run(script, "--dry-run", "--", "--gpu-memory-utilization", "0.85", WIRE=wire, DP="4")
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout)
    assert argv[:2] == ["env", f"MEGA_DISPATCH_WIRE={wire}"]
    assert argv[2:4] == ["vllm", "serve"]
    for flag, value in (("--data-parallel-size", "4"), ("--moe-backend", "megamoe_ep"),
                        ("--tensor-parallel-size", "1"), ("--gpu-memory-utilization", "0.85")):
        assert argv[argv.index(flag) + 1] == value
    assert "--enable-expert-parallel" in argv


@pytest.mark.parametrize("script", SERVE_SCRIPTS)
def test_serve_rejects_unknown_wire(script):
    r = _run(script, "--dry-run", WIRE="fp16")
    assert r.returncode == 2 and "WIRE=fp16 is not valid; allowed: bf16 | fp8 | fp4" in r.stderr


@pytest.mark.parametrize("mode, redundant", [("r0", 0), ("r64", 64)])
def test_serve_eplb_maps_to_vllms_eplb_flags(mode, redundant):
    """EPLB=r0|r64: vLLM's --enable-eplb / --eplb-config with the upstream window and interval, as
    vLLM's own argument parser reads them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    r = _run(SERVE_SCRIPTS[1], "--dry-run", EPLB=mode, DP="8")
    assert r.returncode == 0, r.stderr
    assert "no EPLB balancedness threshold" in r.stderr  # vLLM 0.32 has none; said, not dropped silently
    argv = shlex.split(r.stdout)
    at = argv.index("--enable-eplb")
    assert argv[at + 1] == "--eplb-config"
    parsed = EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(argv[at:at + 3]))
    assert parsed.enable_eplb is True
    cfg = parsed.eplb_config
    assert (cfg.num_redundant_experts, cfg.window_size, cfg.step_interval) == (redundant, 200, 200)
    assert "--enable-eplb" not in shlex.split(_run(SERVE_SCRIPTS[1], "--dry-run").stdout)


@pytest.mark.parametrize("env, message", [
    ({"EPLB": "64"}, "EPLB=64 is not valid; allowed: off | r<redundant experts>"),
    ({"EPLB": "r64", "EPLB_WINDOW": "0"}, "EPLB_WINDOW=0 must be a positive number of steps"),
    ({"EPLB": "r64", "EPLB_THRESHOLD": "0.5"}, "EPLB_THRESHOLD=0.5 must be a number >= 1"),
])
def test_serve_rejects_bad_eplb(env, message):
    r = _run(SERVE_SCRIPTS[0], "--dry-run", **env)
    assert r.returncode == 2 and message in r.stderr and r.stdout == ""


def test_bench_dry_run_standard_workload():
    r = _run("scripts/bench_vllm_serve.sh", "--dry-run", MODEL="tiny", PORT="8123")
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout)
    assert argv[:3] == ["vllm", "bench", "serve"]
    expect = {"--dataset-name": "random", "--random-input-len": "8192", "--random-output-len": "1024",
              "--random-range-ratio": "1.0", "--seed": "0", "--model": "tiny", "--port": "8123"}
    for flag, value in expect.items():
        assert argv[argv.index(flag) + 1] == value
    assert "--ignore-eos" in argv


def test_bench_needs_model():
    r = _run("scripts/bench_vllm_serve.sh", "--dry-run")
    assert r.returncode != 0 and "set MODEL" in r.stderr
