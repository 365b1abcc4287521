"""Server-argument checks against the real sglang 0.5.23 package, in one process (CPU).

Run as ``python sglang_cli_checks.py OUT.json MODEL_DIR_8 MODEL_DIR_6 [SCRIPTS.json]``: two local
model folders holding only a config.json (8 and 6 routed experts), and optionally the argv lists
that scripts/serve_sglang_*.sh print in --dry-run (parsed exactly as `sglang serve` would). Records what SGLang does with each command
line — parsed fields, resolved fields, or the exact exception — for the pytest side to assert.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


# what a printed serve command is checked for (scripts/_sglang_common.sh, scripts/_eplb.sh)
SCRIPT_FIELDS = ("moe_a2a_backend", "tp_size", "attn_dp_size", "ep_size", "enable_eplb", "ep_num_redundant_experts",
                 "expert_distribution_recorder_buffer_size", "eplb_rebalance_num_iterations",
                 "expert_balancedness_report_mode", "eplb_min_rebalancing_utilization_threshold", "context_length",
                 "chunked_prefill_size", "max_running_requests", "kv_cache_dtype", "page_size", "disable_radix_cache",
                 "disable_cuda_graph")


def bench_args(argv: list[str]) -> dict:
    """``python -m sglang.benchmark.serving ARGV`` parsed by its own ``cli_main`` (run_benchmark replaced by a
    recorder), plus the lengths its random dataset draws for the parsed ISL / OSL / range ratio."""
    import importlib.util

    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        # sglang.benchmark.datasets imports HF `datasets` at module level (for MMMU), which this venv does not
        # install: a stand-in whose load_dataset refuses, so the parser and the random-ids sampler import
        # (neither loads an HF dataset)
        import types

        def _no_hf_datasets(*args, **kwargs):
            raise RuntimeError("HF datasets is not installed in the SGLang test venv")

        stand_in = types.ModuleType("datasets")
        stand_in.__spec__ = importlib.util.spec_from_loader("datasets", loader=None)
        stand_in.load_dataset = _no_hf_datasets
        sys.modules["datasets"] = stand_in
    import sglang.benchmark.serving as serving
    from sglang.benchmark.datasets.common import compute_random_lens

    got = {}
    old_run, old_argv = serving.run_benchmark, sys.argv
    serving.run_benchmark = lambda args: got.update(vars(args))
    try:
        sys.argv = ["sglang.benchmark.serving", *argv]
        serving.cli_main()
    finally:
        serving.run_benchmark, sys.argv = old_run, old_argv
    out = {k: v for k, v in got.items() if isinstance(v, (str, int, float, bool, type(None)))}
    if got.get("dataset_name") in ("random", "random-ids"):
        out["sampled_input_lens"] = sorted(set(compute_random_lens(got["random_input_len"], got["random_range_ratio"], 64)))
        out["sampled_output_lens"] = sorted(set(compute_random_lens(got["random_output_len"], got["random_range_ratio"], 64)))
    return out


def attempt(fn):
    try:
        return {"ok": True, **(fn() or {})}
    except SystemExit as exc:
        return {"ok": False, "type": "SystemExit", "message": str(exc)}
    except BaseException as exc:  # recorded for the test to assert on
        return {"ok": False, "type": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc(limit=-3)}


def main() -> None:
    out_path, model8, model6 = sys.argv[1:4]
    res: dict = {}
    t0 = time.perf_counter()
    from importlib.metadata import entry_points

    res["entry_points"] = [f"{ep.name}={ep.value}" for ep in entry_points(group="sglang.srt.plugins")]
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    res["load_plugins_s"] = time.perf_counter() - t0
    res["patched"] = sorted(HookRegistry._patched)
    from sglang.srt.arg_groups.choices import MOE_RUNNER_BACKEND_CHOICES
    from sglang.srt.layers.moe.utils import MoeA2ABackend, resolve_moe_runner_backend
    from sglang.srt.server_args import prepare_server_args

    res["runner_choices_has_megamoe_ep"] = "megamoe_ep" in MOE_RUNNER_BACKEND_CHOICES
    res["runner_resolves"] = repr(resolve_moe_runner_backend("megamoe_ep"))
    res["enum_megamoe_ep"] = str(MoeA2ABackend("megamoe_ep"))
    res["enum_megamoe"] = str(MoeA2ABackend("megamoe"))
    res["enum_bogus"] = attempt(lambda: {"value": str(MoeA2ABackend("bogus"))})

    def fields(sa, names=("moe_a2a_backend", "moe_runner_backend", "tp_size", "attn_dp_size", "ep_size",
                          "enable_dp_attention", "disable_shared_experts_fusion")):
        return {n: getattr(sa, n) for n in names}

    def parse(argv):
        return lambda: {"parsed": fields(prepare_server_args(argv))}

    def with_env(env, body):
        def run():
            old = {k: os.environ.get(k) for k in (env or {})}
            os.environ.update(env or {})
            try:
                return body()
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        return run

    def parse_resolve(argv, env=None, names=None):
        def body():
            sa = prepare_server_args(argv)
            parsed = fields(sa, *(names,) if names else ())
            sa.resolve_once()
            resolved = {k: v for k, v in sa.resolved_dict().items() if k in parsed}
            return {"parsed": parsed, "resolved": resolved}
        return with_env(env, body)

    from sglang.srt.arg_groups.cuda_graph_hook import handle_cuda_graph_config
    from sglang.srt.arg_groups.mega_moe_hook import validate_mega_moe_token_budget_for_model
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.arg_groups.parallel_hook import handle_data_parallelism
    from sglang.srt.arg_groups.resolution_hooks import run_hook

    def budget(argv, env=None):
        """SGLang's resolution steps that size a forward (graph config, DP division of the chunked
        prefill), then the budget step megamoe_ep overrides — each through SGLang's run_hook, as
        the pipeline calls them (a full resolution needs an accelerator on this machine)."""
        def body():
            from megamoe_sglang.runtime import captures_graphs
            from megamoe_sglang.token_budget import budget_from_server_args

            sa = prepare_server_args(argv)
            run_hook(handle_cuda_graph_config, sa)
            run_hook(handle_data_parallelism, sa)
            view = resolving_view(sa)
            out = {"per_rank": budget_from_server_args(view).per_rank(),
                   "captures_graphs": captures_graphs(view.cuda_graph_config)}
            run_hook(validate_mega_moe_token_budget_for_model, sa)
            return out
        return with_env(env, body)

    dp8 = ["--tp", "8", "--attn-dp-size", "8", "--ep-size", "8"]
    res["dsv4_parse"] = attempt(parse(["--model-path", model8, *dp8, "--moe-a2a-backend", "megamoe_ep"]))
    res["r1_alias_parse"] = attempt(parse(["--model-path", model8, *dp8, "--moe-runner-backend", "megamoe_ep"]))
    res["dummy_resolve"] = attempt(parse_resolve(["--model-path", "dummy", *dp8, "--moe-a2a-backend", "megamoe_ep"]))
    res["alias_resolve"] = attempt(parse_resolve(["--model-path", "dummy", *dp8, "--moe-runner-backend", "megamoe_ep"]))
    res["bad_wire"] = attempt(parse_resolve(["--model-path", "dummy", *dp8, "--moe-a2a-backend", "megamoe_ep"],
                                            {"MEGA_DISPATCH_WIRE": "fp16"}))
    res["bad_combine"] = attempt(parse_resolve(["--model-path", "dummy", *dp8, "--moe-a2a-backend", "megamoe_ep"],
                                               {"MEGA_COMBINE_WIRE": "fp8"}))
    res["ep_not_dividing"] = attempt(parse_resolve(["--model-path", model6, "--tp", "4", "--attn-dp-size", "4",
                                                    "--ep-size", "4", "--moe-a2a-backend", "megamoe_ep"]))
    res["ep_ne_tp"] = attempt(parse_resolve(["--model-path", "dummy", "--tp", "4", "--ep-size", "2",
                                             "--moe-a2a-backend", "megamoe_ep"]))
    res["full_resolve_real_config"] = attempt(parse_resolve(["--model-path", model8, "--tp", "2", "--attn-dp-size", "2",
                                                             "--ep-size", "2", "--moe-a2a-backend", "megamoe_ep"]))
    res["unknown_a2a"] = attempt(parse(["--model-path", "dummy", "--moe-a2a-backend", "megamoe_epx"]))
    res["intree_megamoe_parse"] = attempt(parse(["--model-path", "dummy", *dp8, "--moe-a2a-backend", "megamoe"]))
    res["intree_megamoe_resolve"] = attempt(parse_resolve(["--model-path", "dummy", *dp8, "--moe-a2a-backend", "megamoe"]))
    res["intree_alias_resolve"] = attempt(parse_resolve(["--model-path", "dummy", *dp8, "--moe-runner-backend", "megamoe"]))
    res["none_resolve"] = attempt(parse_resolve(["--model-path", "dummy", *dp8]))
    eplb_fields = ("moe_a2a_backend", "enable_eplb", "ep_num_redundant_experts", "ep_dispatch_algorithm",
                   "expert_distribution_recorder_mode")
    res["eplb_resolve"] = attempt(parse_resolve(["--model-path", "dummy", *dp8, "--moe-a2a-backend", "megamoe_ep",
                                                 "--enable-eplb", "--ep-num-redundant-experts", "64"], names=eplb_fields))
    res["eplb_not_dividing"] = attempt(parse_resolve(["--model-path", model8, "--tp", "4", "--attn-dp-size", "4",
                                                      "--ep-size", "4", "--moe-a2a-backend", "megamoe_ep",
                                                      "--enable-eplb", "--ep-num-redundant-experts", "2"]))
    ep4 = ["--model-path", model8, "--tp", "4", "--ep-size", "4", "--moe-a2a-backend", "megamoe_ep"]
    dp4 = [*ep4, "--attn-dp-size", "4", "--cuda-graph-max-bs-decode", "256", "--max-running-requests", "1024"]
    res["budget_dp4"] = attempt(budget([*dp4, "--chunked-prefill-size", "16384"]))
    res["budget_dp4_eager"] = attempt(budget([*dp4, "--chunked-prefill-size", "16384", "--disable-cuda-graph"]))
    res["budget_dp4_small_mtpr"] = attempt(budget([*dp4, "--chunked-prefill-size", "16384"],
                                                  {"MEGA_MAX_TOKENS_PER_RANK": "2048"}))
    res["budget_spec"] = attempt(budget([*ep4, "--attn-dp-size", "4", "--chunked-prefill-size", "8192",
                                         "--cuda-graph-max-bs-decode", "512", "--max-running-requests", "4096",
                                         "--speculative-algorithm", "EAGLE", "--speculative-num-draft-tokens", "4"],
                                        {"MEGA_MAX_TOKENS_PER_RANK": "2048"}))
    res["budget_no_chunking"] = attempt(budget([*dp4, "--chunked-prefill-size", "-1"]))
    res["budget_pure_tp"] = attempt(budget([*ep4, "--chunked-prefill-size", "16384"],
                                           {"MEGA_MAX_TOKENS_PER_RANK": "2048"}))
    res["budget_other_backend"] = attempt(budget(["--model-path", model8, "--tp", "4", "--chunked-prefill-size", "16384"],
                                                 {"MEGA_MAX_TOKENS_PER_RANK": "16"}))
    if len(sys.argv) > 4:
        for name, argv in json.loads(open(sys.argv[4]).read()).items():
            if name.startswith("bench:"):
                res[f"script:{name}"] = attempt(lambda argv=argv: {"parsed": bench_args(argv)})
            else:
                res[f"script:{name}"] = attempt(lambda argv=argv: {"parsed": fields(prepare_server_args(argv), SCRIPT_FIELDS)})
    res["total_s"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
