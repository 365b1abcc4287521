"""One SGLang rank process for the start-up table (test_startup_engine.py): started as a server
process is (sglang_worker.start_sglang: plugins, server args, publish, gloo distributed init), then,
per case of tests/startup_facts.py whose graph setting matches this process's server args, SGLang's
own FusedMoE built and loaded through its weight loader: the plugin's start-up up to the layer's
decision. ``python sglang_startup_worker.py RANK WORLD PORT OUT.json [server args]``.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_worker import EXPERTS, HIDDEN, INTER, TOPK, all_experts, load_like_sglang, start_sglang  # noqa: E402
from startup_facts import CASES, inject, outcome  # noqa: E402


def publish_graph_config(argv: list[str]) -> None:
    """Publish the CudaGraphConfig SGLang's own resolution step (handle_cuda_graph_config) makes of
    these server args, as a GPU server's resolution does (on this CPU the full resolution needs an
    accelerator and leaves the graph config unpublished)."""
    from sglang.srt.arg_groups.cuda_graph_hook import handle_cuda_graph_config
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.arg_groups.resolution_hooks import run_hook
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv)
    run_hook(handle_cuda_graph_config, args)
    get_context().override("megamoe-startup-test", cuda_graph_config=resolving_view(args).cuda_graph_config)


def main() -> None:
    rank, world, port, out_path, extra = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
    result: dict = {"rank": rank, "world": world, "cases": {}}
    try:
        start_sglang(rank, world, port, extra)
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

        from megamoe_sglang.runtime import sglang_captures_graphs

        publish_graph_config(["--model-path", "dummy", "--moe-a2a-backend", "megamoe_ep", *extra])
        result["captures_graphs"] = graphs = sglang_captures_graphs()
        ckpt = all_experts("bf16")[2]
        for layer_id, case in enumerate(c for c in CASES if c.graphs == graphs):
            inject(case, rank, world)

            def build():
                layer = FusedMoE(num_experts=EXPERTS, top_k=TOPK, hidden_size=HIDDEN, intermediate_size=INTER,
                                 layer_id=layer_id, params_dtype=torch.bfloat16, reduce_results=False, quant_config=None,
                                 prefix=f"model.layers.{layer_id}.mlp.experts")
                load_like_sglang(layer, ckpt)  # process_weights_after_loading: convert, then the runtime
            result["cases"][case.name] = outcome(build)
        result["ok"] = True
    except BaseException:
        result["ok"] = False
        result["error"] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
