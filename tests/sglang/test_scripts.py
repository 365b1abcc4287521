"""scripts/serve_sglang_*.sh and scripts/bench_sglang_serve.sh: dry runs print the expected lines,
and the printed serve command parses in SGLang (with the plugin) exactly as `sglang serve` would."""

from __future__ import annotations

import pytest

from sglang_test_env import dry_run


def test_dsv4_pro_dry_run_prints_expected_command():
    proc = dry_run("serve_sglang_dsv4_pro_ep.sh", {"MODEL": "/models/DeepSeek-V4-Pro"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "env MEGA_DISPATCH_WIRE=bf16",
        "sglang serve --model-path /models/DeepSeek-V4-Pro --trust-remote-code --tp 8 --attn-dp-size 8 "
        "--ep-size 8 --moe-a2a-backend megamoe_ep --host 127.0.0.1 --port 30000",
    ]


def test_r1_mxfp4_dry_run_maps_wire_and_knobs():
    env = {"N": "4", "WIRE": "fp4", "COMBINE_WIRE": "fp8_blockwise_1x32", "MTPR": "4096", "PORT": "31000",
           "MODEL": "/models/R1-MXFP4", "CUDA_GRAPH": "1"}
    proc = dry_run("serve_sglang_r1_mxfp4_ep.sh", env, ("--mem-fraction-static", "0.8"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "env MEGA_DISPATCH_WIRE=fp4 MEGA_COMBINE_WIRE=fp8_blockwise_1x32 MEGA_MAX_TOKENS_PER_RANK=4096",
        "sglang serve --model-path /models/R1-MXFP4 --trust-remote-code --tp 4 --attn-dp-size 4 --ep-size 4 "
        "--moe-a2a-backend megamoe_ep --host 127.0.0.1 --port 31000 --mem-fraction-static 0.8",
    ]


@pytest.mark.parametrize("env, graphed", [({"N": "1"}, True), ({"N": "1", "CUDA_GRAPH": "0"}, False),
                                           ({"N": "2"}, True), ({"N": "8", "TRANSPORT": "auto"}, True),
                                           ({"N": "2", "TRANSPORT": "symm"}, True), ({"N": "4", "TRANSPORT": "ipc"}, True),
                                           ({"N": "2", "TRANSPORT": "nccl"}, False),
                                           ({"N": "2", "TRANSPORT": "mori"}, False),
                                           ({"N": "1", "TRANSPORT": "nccl"}, True),
                                           ({"N": "2", "TRANSPORT": "nccl", "CUDA_GRAPH": "1"}, True),
                                           ({"N": "2", "TRANSPORT": "ipc", "CUDA_GRAPH": "0"}, False)])
def test_cuda_graphs_on_by_default(env, graphed):
    """Graphs stay on unless the operator picked a transport whose forward cannot be captured at N>1
    (nccl, mori, flydsl): MEGA_DISPATCH=auto picks a capturable peer transport on one host, and if
    it cannot, the plugin refuses the start naming --disable-cuda-graph (never a crash in capture)."""
    proc = dry_run("serve_sglang_r1_mxfp4_ep.sh", {"MODEL": "/m", **env})
    assert proc.returncode == 0, proc.stderr
    assert ("--disable-cuda-graph" not in proc.stdout) == graphed


def test_eplb_dry_run_prints_sglangs_eplb_flags():
    """EPLB=r64 with the upstream window / interval / threshold (defaults 200 / 200 / 2.0)."""
    proc = dry_run("serve_sglang_dsv4_pro_ep.sh", {"MODEL": "/m", "EPLB": "r64"}, ("--mem-fraction-static", "0.8"))
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.splitlines()[1]
    assert cmd.endswith(" --enable-eplb --ep-num-redundant-experts 64 --expert-distribution-recorder-buffer-size 200 "
                        "--eplb-rebalance-num-iterations 200 --expert-balancedness-report-mode server_log "
                        "--eplb-min-rebalancing-utilization-threshold 0.5 --mem-fraction-static 0.8"), cmd
    r0 = dry_run("serve_sglang_dsv4_pro_ep.sh", {"EPLB": "r0", "EPLB_WINDOW": "100", "EPLB_THRESHOLD": "4"})
    assert "--ep-num-redundant-experts 0 --expert-distribution-recorder-buffer-size 100 " in r0.stdout
    assert "--eplb-min-rebalancing-utilization-threshold 0.25" in r0.stdout  # SGLang's balancedness: mean / max


@pytest.mark.parametrize("env, message", [
    ({"WIRE": "fp16"}, "WIRE=fp16 (MEGA_DISPATCH_WIRE) is not valid; allowed values: bf16 | fp8 | fp4"),
    ({"N": "0"}, "N=0 must be a positive GPU count"),
    ({"CUDA_GRAPH": "yes"}, "CUDA_GRAPH=yes must be 0 or 1"),
    ({"EPLB": "r-1"}, "EPLB=r-1 is not valid; allowed: off | r<redundant experts>"),
])
def test_serve_script_refuses_bad_input(env, message):
    proc = dry_run("serve_sglang_r1_mxfp4_ep.sh", env)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


def test_bench_dry_run_is_offline_random_ids():
    env = {"MODEL": "/models/R1", "ISL": "128", "OSL": "64", "PROMPTS": "32", "CONCURRENCY": "8", "OUT": "r.jsonl",
           "PYTHON": "python3"}
    proc = dry_run("bench_sglang_serve.sh", env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "env HF_HUB_OFFLINE=1",
        "python3 -m sglang.benchmark.serving --backend sglang --host 127.0.0.1 --port 30000 --model /models/R1 "
        "--tokenizer /models/R1 --dataset-name random-ids --random-input-len 128 --random-output-len 64 "
        "--random-range-ratio 1.0 --num-prompts 32 --max-concurrency 8 --seed 42 --output-file r.jsonl",
    ]
    bad = dry_run("bench_sglang_serve.sh", {"ISL": "x"})
    assert bad.returncode == 2 and "ISL=x must be a positive integer" in bad.stderr


@pytest.mark.engine
def test_printed_serve_commands_parse_in_sglang(checks, script_argv):
    for name in script_argv:
        r = checks[f"script:{name}"]
        assert r["ok"], r
        assert r["parsed"]["moe_a2a_backend"] == "megamoe_ep"
    assert "--disable-cuda-graph" not in script_argv["dsv4"]  # graphs on by default
    assert checks["script:r1"]["parsed"]["ep_size"] == 4 and checks["script:dsv4"]["parsed"]["tp_size"] == 8
    eplb = checks["script:r1_eplb"]["parsed"]
    assert {k: eplb[k] for k in ("enable_eplb", "ep_num_redundant_experts", "expert_distribution_recorder_buffer_size",
                                 "eplb_rebalance_num_iterations", "eplb_min_rebalancing_utilization_threshold",
                                 "expert_balancedness_report_mode")} == {
        "enable_eplb": True, "ep_num_redundant_experts": 64, "expert_distribution_recorder_buffer_size": 200,
        "eplb_rebalance_num_iterations": 200, "eplb_min_rebalancing_utilization_threshold": 0.5,
        "expert_balancedness_report_mode": "server_log"}
    assert checks["script:r1"]["parsed"]["enable_eplb"] is False
