"""Build MoE layers of a MoNE-pruned checkpoint with vLLM's own ``FusedMoEFactory``; print what happened.

Run as ``python substitution_probe.py`` (one process; vLLM's distributed state is set up once). The
checkpoint's ``approximate_experts`` (layer 1: experts 0 and 3 replaced by constants) reaches vLLM the way
a served model's does, through ``model_config.hf_config`` (read by vLLM's ``make_expert_substitution``).
For each (moe_backend, layer) it prints the routed-experts class vLLM built and its quant method, or the
error. Layer 2 has no substituted experts: vLLM builds plain ``RoutedExperts`` there.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

APPROXIMATE_EXPERTS = {"1": [0, 3]}


def build(vcfg, backend: str, layer_index: int) -> dict:
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    vcfg.kernel_config.moe_backend = backend
    hf = SimpleNamespace(approximate_experts=APPROXIMATE_EXPERTS)
    vcfg.model_config = SimpleNamespace(hf_config=hf, hf_text_config=hf, dtype=torch.bfloat16, quantization_config=None)
    try:
        layer = FusedMoEFactory(
            num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, params_dtype=torch.bfloat16,
            renormalize=True, prefix=f"{backend}.layers.{layer_index}.mlp.experts", scoring_func="sigmoid",
        )  # the prefix names the layer (unique per build) and its one layer index
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {"error": f"{type(exc).__name__}: {exc}"}
    experts = layer.routed_experts
    return {"class": type(experts).__name__, "mro": [c.__name__ for c in type(experts).__mro__],
            "quant_method": type(experts.quant_method).__name__}


def main() -> None:
    import megamoe_vllm
    from vllm.config import set_current_vllm_config

    from layer_harness import init_ranks, vllm_config

    megamoe_vllm.register()
    vcfg = vllm_config(1, "auto")
    with set_current_vllm_config(vcfg):
        init_ranks(0, 1, int(os.environ.get("PROBE_PORT", "29656")))
        results = {f"{b}/{i}": build(vcfg, b, i) for b in ("auto", "megamoe_ep") for i in (1, 2)}
    print("PROBE_RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
