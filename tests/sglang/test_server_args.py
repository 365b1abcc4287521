"""The plugin as SGLang loads it: entry point, hooks, CLI parsing and resolution (CPU, real sglang)."""

from __future__ import annotations

import pytest

from sglang_test_env import run_python

pytestmark = pytest.mark.engine

HOOK_TARGETS = {
    "sglang.srt.server_args.ServerArgs.add_cli_args",
    "sglang.srt.layers.moe.utils.MoeA2ABackend._missing_",
    "sglang.srt.layers.moe.utils.MoeA2ABackend.supports_aiter",
    "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher",
    "sglang.srt.layers.moe.utils.post_experts_output_is_complete",
    "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.run_moe_core",
    "sglang.srt.utils.common.require_mlp_tp_gather",
}


def test_load_plugins_finds_and_applies_the_plugin(checks):
    assert checks["entry_points"] == ["megamoe_ep=megamoe_sglang:register"]
    assert HOOK_TARGETS <= set(checks["patched"])
    assert checks["runner_choices_has_megamoe_ep"]
    assert checks["runner_resolves"] == "RegisteredMoeRunnerBackend(value='megamoe_ep')"
    assert checks["enum_megamoe_ep"] == "MoeA2ABackend.CUSTOMIZED"


def test_dsv4_pro_command_line_parses(checks):
    r = checks["dsv4_parse"]
    assert r["ok"], r
    assert r["parsed"]["moe_a2a_backend"] == "megamoe_ep"
    assert (r["parsed"]["tp_size"], r["parsed"]["attn_dp_size"], r["parsed"]["ep_size"]) == (8, 8, 8)


def test_runner_backend_alias_resolves_to_a2a_backend(checks):
    assert checks["r1_alias_parse"]["parsed"]["moe_runner_backend"] == "megamoe_ep"
    resolved = checks["alias_resolve"]["resolved"]
    assert resolved["moe_a2a_backend"] == "megamoe_ep"
    assert resolved["moe_runner_backend"] == "auto"


def test_resolution_places_shared_experts_outside_routed(checks):
    r = checks["dummy_resolve"]
    assert r["ok"], r
    assert r["resolved"]["moe_a2a_backend"] == "megamoe_ep"
    assert r["resolved"]["enable_dp_attention"] is True
    assert r["resolved"]["disable_shared_experts_fusion"] is True
    assert checks["none_resolve"]["resolved"]["disable_shared_experts_fusion"] is False


def test_unknown_wire_fails_with_the_knob_error(checks):
    assert checks["bad_wire"]["type"] == "KnobError"
    assert "MEGA_DISPATCH_WIRE='fp16'" in checks["bad_wire"]["message"]
    assert checks["bad_combine"]["type"] == "KnobError"
    assert "MEGA_COMBINE_WIRE" in checks["bad_combine"]["message"]


def test_ep_size_must_divide_experts_and_equal_tp(checks):
    r = checks["ep_not_dividing"]
    assert r["type"] == "MegaMoEConfigError" and "--ep-size 4 does not divide the model's 6" in r["message"]
    r = checks["ep_ne_tp"]
    assert r["type"] == "MegaMoEConfigError" and "--ep-size equal to --tp" in r["message"]


def test_eplb_passes_resolution_and_uneven_physical_counts_do_not(checks):
    """--enable-eplb with redundant experts passes megamoe_ep's resolution step (it was refused
    before); an uneven physical count is refused there, naming both flags."""
    r = checks["eplb_resolve"]
    assert r["ok"], r
    assert {k: r["resolved"][k] for k in ("moe_a2a_backend", "enable_eplb", "ep_num_redundant_experts")} == {
        "moe_a2a_backend": "megamoe_ep", "enable_eplb": True, "ep_num_redundant_experts": 64}
    r = checks["eplb_not_dividing"]
    assert r["type"] == "MegaMoEConfigError", r
    assert "--ep-size 4 does not divide the model's 10 routed experts (n_routed_experts + --ep-num-redundant" in r["message"]


def test_full_resolution_of_a_real_model_needs_an_accelerator(checks):
    """What does not run on CPU, exactly: resolution past the model-independent steps."""
    r = checks["full_resolve_real_config"]
    assert r["type"] == "RuntimeError"
    assert "No accelerator" in r["message"]


def test_in_tree_megamoe_untouched(checks):
    assert checks["enum_megamoe"] == "MoeA2ABackend.MEGAMOE"
    assert checks["enum_bogus"]["type"] == "ValueError"  # the enum hook passes other names through
    assert checks["intree_megamoe_parse"]["parsed"]["moe_a2a_backend"] == "megamoe"
    # SGLang's own check still runs (and on CPU refuses, with its own message)
    for key in ("intree_megamoe_resolve", "intree_alias_resolve"):
        assert checks[key]["type"] == "ValueError"
        assert "--moe-a2a-backend megamoe needs a CUDA SM90 GPU" in checks[key]["message"]


def test_misspelt_backend_is_an_argparse_error(checks):
    assert checks["unknown_a2a"]["type"] == "SystemExit"


def test_without_the_plugin_sglang_refuses_megamoe_ep_by_name():
    """SGLANG_PLUGINS whitelists other plugins only: SGLang then rejects the choice itself."""
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins();"
        "from sglang.srt.server_args import prepare_server_args;"
        "prepare_server_args(['--model-path','dummy','--moe-a2a-backend','megamoe_ep'])"
    )
    proc = run_python(["-c", code], env={"SGLANG_PLUGINS": "some_other_plugin"})
    assert proc.returncode == 2
    assert "argument --moe-a2a-backend: invalid choice: 'megamoe_ep'" in proc.stderr


def test_token_budget_passes_within_mtpr(checks):
    """DP 4 (--chunked-prefill-size 16384 is 4096 per DP rank after SGLang's DP step), decode graphs
    of 256, 1024 running requests (256 per DP rank): every forward fits MEGA_MAX_TOKENS_PER_RANK=8192."""
    r = checks["budget_dp4"]
    assert r["ok"], r
    assert r["per_rank"] == {"--chunked-prefill-size": 4096, "--cuda-graph-max-bs-prefill": 0,
                             "--cuda-graph-max-bs-decode x --speculative-num-draft-tokens": 256}
    assert r["captures_graphs"] is True
    assert checks["budget_dp4_eager"]["captures_graphs"] is False  # --disable-cuda-graph


@pytest.mark.parametrize("case, needle", [
    ("budget_dp4_small_mtpr", "one forward can bring 4096 tokens to an EP rank (--chunked-prefill-size), more than "
                              "MEGA_MAX_TOKENS_PER_RANK=2048. Raise MEGA_MAX_TOKENS_PER_RANK to at least 4096 or lower "
                              "--chunked-prefill-size"),
    ("budget_spec", "one forward can bring 4096 tokens to an EP rank (--max-running-requests / --attn-dp-size 4 x "
                    "--speculative-num-draft-tokens), more than MEGA_MAX_TOKENS_PER_RANK=2048"),
    ("budget_pure_tp", "one forward can bring 4096 tokens to an EP rank (--chunked-prefill-size over 4 attention-TP "
                       "ranks), more than MEGA_MAX_TOKENS_PER_RANK=2048"),
    ("budget_no_chunking", "needs chunked prefill (--chunked-prefill-size > 0, got -1)"),
])
def test_token_budget_over_mtpr_fails_resolution_naming_numbers_and_flags(checks, case, needle):
    r = checks[case]
    assert r["type"] == "MegaMoEConfigError", r
    assert needle in r["message"], r["message"]


def test_token_budget_leaves_other_backends_alone(checks):
    assert checks["budget_other_backend"]["ok"], checks["budget_other_backend"]
