"""vLLM's own MoE layer objects, outside the engine: build, load, forward — per rank.

Why: the engine tests show the plugin end to end, but only a layer-level run can compare the
MegaMoE path and vLLM's default path on the *same* inputs, number by number, and drive EP over
several gloo ranks without vLLM's multi-process engine. Everything here uses vLLM's public
objects: ``init_distributed_environment`` / ``initialize_model_parallel`` (gloo), a ``VllmConfig``,
``FusedMoEFactory`` (the constructor DeepSeek-V2/V3 use), the ``RoutedExperts.weight_loader``
(global expert ids; non-local experts are skipped by vLLM), the quant method's
``process_weights_after_loading``, and the runner's ``forward`` inside ``set_forward_context``.

``run_rank`` is the body of one rank; ``python layer_harness.py`` is not an entry point.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoECase:
    hidden: int = 256
    inter: int = 128
    experts: int = 8
    topk: int = 2
    n_group: int = 4
    topk_group: int = 2
    tokens: int = 24
    routed_scaling_factor: float = 2.5
    seed: int = 0


def case_tensors(case: MoECase) -> dict[str, torch.Tensor]:
    """Deterministic inputs, router logits, correction bias and per-expert weights (bf16)."""
    g = torch.Generator().manual_seed(case.seed)
    h, i = case.hidden, case.inter
    t = {
        "x": torch.randn(case.tokens, h, generator=g).to(torch.bfloat16),
        "logits": torch.randn(case.tokens, case.experts, generator=g),
        "bias": (torch.rand(case.experts, generator=g) - 0.5) * 0.4,
    }
    for e in range(case.experts):
        t[f"{e}.gate"] = (torch.randn(i, h, generator=g) / h**0.5).to(torch.bfloat16)
        t[f"{e}.up"] = (torch.randn(i, h, generator=g) / h**0.5).to(torch.bfloat16)
        t[f"{e}.down"] = (torch.randn(h, i, generator=g) / i**0.5).to(torch.bfloat16)
    return t


def run_rank(rank: int, world: int, port: int, case: MoECase, moe_backend: str, env: dict[str, str]) -> torch.Tensor:
    """Build a DeepSeek-style MoE layer with TP=world + EP on this rank and return its output.

    With ``--enable-expert-parallel`` and TP=world the EP group is the TP group: every rank holds
    the same tokens and experts/world of the experts; the runner sums over TP at the end.
    """
    os.environ.update(env)
    from vllm.config import CompilationConfig, DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.kernel import KernelConfig
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    vcfg = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=world, enable_expert_parallel=world > 1),
        device_config=DeviceConfig("cpu"),
        kernel_config=KernelConfig(moe_backend=moe_backend),
        compilation_config=CompilationConfig(),
    )
    t = case_tensors(case)
    # vLLM's CPU worker names its shared-memory groups after this (cpu_worker.py sets it from the init
    # method's port); the CPU communicator reads it on CPUs where vLLM's SHM all-reduce is built.
    os.environ.setdefault("VLLM_DIST_IDENT", str(port))
    with set_current_vllm_config(vcfg):
        init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=world)
        layer = FusedMoEFactory(
            num_experts=case.experts, top_k=case.topk, hidden_size=case.hidden, intermediate_size=case.inter,
            params_dtype=torch.bfloat16, renormalize=True, use_grouped_topk=True, num_expert_group=case.n_group,
            topk_group=case.topk_group, prefix="model.layers.1.mlp.experts", scoring_func="sigmoid",
            routed_scaling_factor=case.routed_scaling_factor, e_score_correction_bias=t["bias"],
        )
        experts = layer.routed_experts
        for e in range(case.experts):
            for shard, key, param in (("w1", "gate", experts.w13_weight), ("w3", "up", experts.w13_weight),
                                      ("w2", "down", experts.w2_weight)):
                experts.weight_loader(param, t[f"{e}.{key}"], f"experts.{e}.{key}_proj.weight", shard, e)
        experts.quant_method.process_weights_after_loading(experts)
        with set_forward_context(None, vcfg, num_tokens=case.tokens):
            out = layer.forward(t["x"].clone(), t["logits"].clone())
    return out.float()


def reference_moe(case: MoECase) -> torch.Tensor:
    """fp32 reference of the same layer: core's route() + plain SwiGLU experts (no quantisation)."""
    from megamoe_backend.layer import route
    from megamoe_backend.spec import MoESpec

    t = case_tensors(case)
    spec = MoESpec(hidden_size=case.hidden, moe_intermediate_size=case.inter, n_routed_experts=case.experts,
                   num_experts_per_tok=case.topk, n_group=case.n_group, topk_group=case.topk_group,
                   scoring_func="sigmoid", topk_method="noaux_tc", routed_scaling_factor=case.routed_scaling_factor)
    ids, w = route(t["logits"], spec, t["bias"])
    x = t["x"].float()
    out = torch.zeros_like(x)
    for tok in range(case.tokens):
        for k in range(case.topk):
            e = int(ids[tok, k])
            h = torch.nn.functional.silu(x[tok] @ t[f"{e}.gate"].float().T) * (x[tok] @ t[f"{e}.up"].float().T)
            out[tok] += w[tok, k] * (h @ t[f"{e}.down"].float().T)
    return out
