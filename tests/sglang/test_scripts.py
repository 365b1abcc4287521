"""The command lines scripts/serve_sglang_*.sh and scripts/bench_sglang_serve.sh print (--dry-run) parse
in SGLang 0.5.23 (with the plugin) exactly as `sglang serve` and `python -m sglang.benchmark.serving`
parse them, into the reference run; SGLang's own random-length sampler draws fixed ISL / OSL for the
script's range ratio. What the dry runs print in both engines (same variables, defaults, refusals,
the `megamoe info` check): tests/core/test_scripts_dry_run.py."""

from __future__ import annotations

import pytest

from sglang_test_env import dry_run, printed_commands


def test_dry_run_prints_env_and_command(model_dirs):
    proc = dry_run("serve_sglang_dsv4_pro_ep.sh", {"MODEL": str(model_dirs[8]), "WIRE": "fp4", "SGLANG_PLUGINS": "megamoe"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "env MEGA_DISPATCH_WIRE=fp4 SGLANG_PLUGINS=megamoe"
    (cmd,) = printed_commands(proc)
    assert cmd == ["sglang", "serve", "--model-path", str(model_dirs[8]), "--trust-remote-code", "--host", "127.0.0.1",
                   "--port", "30000", "--tp", "8", "--attn-dp-size", "8", "--ep-size", "8", "--moe-a2a-backend",
                   "megamoe_ep", "--kv-cache-dtype", "fp8_e4m3"]


def test_check_runs_megamoe_info_on_the_model_folder(model_dirs):
    """CHECK=1 (the default outside tests): the folder's config.json is read, with this venv's sglang version."""
    proc = dry_run("serve_sglang_r1_mxfp4_ep.sh", {"MODEL": str(model_dirs[8]), "CHECK": "1", "N": "4"})
    assert proc.returncode == 0, proc.stderr
    assert f"--model {model_dirs[8]} --ep-size 4 --device cuda --redundant-experts 0 --engine sglang-0.5.23" in proc.stderr
    bad = dry_run("serve_sglang_r1_mxfp4_ep.sh", {"MODEL": str(model_dirs[8]), "CHECK": "1", "N": "4", "WIRE": "fp4"})
    assert bad.returncode == 2 and "MEGA_DISPATCH_WIRE=fp4 does not match the experts: quant=bf16" in bad.stderr


@pytest.mark.engine
def test_printed_serve_commands_parse_in_sglang(checks, script_argv):
    for name in ("dsv4", "r1", "r1_eplb", "r1_ref"):
        r = checks[f"script:{name}"]
        assert r["ok"], r
        assert r["parsed"]["moe_a2a_backend"] == "megamoe_ep"
    assert checks["script:r1"]["parsed"]["ep_size"] == 4 and checks["script:dsv4"]["parsed"]["tp_size"] == 8
    assert checks["script:dsv4"]["parsed"]["disable_cuda_graph"] is False  # graphs on by default
    eplb = checks["script:r1_eplb"]["parsed"]
    assert {k: eplb[k] for k in ("enable_eplb", "ep_num_redundant_experts", "expert_distribution_recorder_buffer_size",
                                 "eplb_rebalance_num_iterations", "eplb_min_rebalancing_utilization_threshold",
                                 "expert_balancedness_report_mode")} == {
        "enable_eplb": True, "ep_num_redundant_experts": 64, "expert_distribution_recorder_buffer_size": 200,
        "eplb_rebalance_num_iterations": 200, "eplb_min_rebalancing_utilization_threshold": 0.5,
        "expert_balancedness_report_mode": "server_log"}
    assert checks["script:r1"]["parsed"]["enable_eplb"] is False


@pytest.mark.engine
def test_reference_preset_parses_into_the_reference_plan(checks):
    ref = checks["script:r1_ref"]["parsed"]
    assert {k: ref[k] for k in ("tp_size", "attn_dp_size", "ep_size", "context_length", "chunked_prefill_size",
                                 "max_running_requests", "kv_cache_dtype", "page_size", "disable_radix_cache",
                                 "enable_eplb", "ep_num_redundant_experts", "eplb_rebalance_num_iterations")} == {
        "tp_size": 8, "attn_dp_size": 8, "ep_size": 8, "context_length": 9472,
        "chunked_prefill_size": 8192 * 8, "max_running_requests": 512 * 8,  # totals: SGLang divides by attn-dp
        "kv_cache_dtype": "fp8_e4m3", "page_size": 16, "disable_radix_cache": True, "enable_eplb": True,
        "ep_num_redundant_experts": 0, "eplb_rebalance_num_iterations": 200}
    default = checks["script:r1_ref_default"]
    assert default["ok"], default
    assert default["parsed"]["moe_a2a_backend"] != "megamoe_ep"  # SGLang's own MoE path
    assert {k: v for k, v in default["parsed"].items() if k != "moe_a2a_backend"} == \
        {k: v for k, v in ref.items() if k != "moe_a2a_backend"}


@pytest.mark.engine
def test_reference_bench_parses_with_fixed_lengths(checks):
    points = []
    for name in ("bench:0", "bench:1"):
        r = checks[f"script:{name}"]
        assert r["ok"], r
        b = r["parsed"]
        assert (b["dataset_name"], b["random_input_len"], b["random_output_len"], b["seed"], b["request_rate"],
                b["warmup_requests"], b["disable_ignore_eos"]) == ("random-ids", 8192, 1024, 0, float("inf"), 64, False)
        assert (b["sampled_input_lens"], b["sampled_output_lens"]) == ([8192], [1024])  # SGLang's own sampler
        points.append((b["max_concurrency"], b["num_prompts"]))
    assert points == [(512, 5120), (4096, 8192)]
    share = checks["script:bench:2"]
    assert share["ok"] and (share["parsed"]["dataset_name"], share["parsed"]["dataset_path"]) == ("sharegpt", "/d/sg.json")
