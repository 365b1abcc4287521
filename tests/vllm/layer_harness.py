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


def vllm_config(world: int, moe_backend: str, redundant_experts: int | None = None):
    """The VllmConfig of one layer-level rank: TP=world (+EP when world > 1) on CPU.

    ``redundant_experts`` switches EPLB on with that many redundant experts. vLLM's ParallelConfig
    refuses EPLB on a non-CUDA platform at validation, so it is set after validation here: the
    layer objects vLLM builds from the config are the ones it builds on GPUs.
    """
    from vllm.config import CompilationConfig, DeviceConfig, ParallelConfig, VllmConfig
    from vllm.config.kernel import KernelConfig

    vcfg = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=world, enable_expert_parallel=world > 1),
        device_config=DeviceConfig("cpu"),
        kernel_config=KernelConfig(moe_backend=moe_backend),
        compilation_config=CompilationConfig(),
    )
    if redundant_experts is not None:
        vcfg.parallel_config.enable_eplb = True
        vcfg.parallel_config.eplb_config.num_redundant_experts = redundant_experts
    return vcfg


def init_ranks(rank: int, world: int, port: int) -> None:
    """vLLM's distributed init over gloo (inside ``set_current_vllm_config``)."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    # vLLM's CPU worker names its shared-memory groups after this (cpu_worker.py sets it from the init
    # method's port); the CPU communicator reads it on CPUs where vLLM's SHM all-reduce is built.
    os.environ.setdefault("VLLM_DIST_IDENT", str(port))
    init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=world)


def build_and_load(case: MoECase, t: dict[str, torch.Tensor], redundant_experts: int | None = None):
    """vLLM's DeepSeek-style MoE runner, every checkpoint expert loaded through vLLM's own mapping
    (``get_expert_mapping``: physical slot -> logical checkpoint expert, EPLB replicas included) and
    ``weight_loader`` (non-local slots skipped), then ``process_weights_after_loading``."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    layer = FusedMoEFactory(
        num_experts=case.experts, top_k=case.topk, hidden_size=case.hidden, intermediate_size=case.inter,
        params_dtype=torch.bfloat16, renormalize=True, use_grouped_topk=True, num_expert_group=case.n_group,
        topk_group=case.topk_group, prefix="model.layers.1.mlp.experts", scoring_func="sigmoid",
        routed_scaling_factor=case.routed_scaling_factor, e_score_correction_bias=t["bias"],
        enable_eplb=redundant_experts is not None, num_redundant_experts=redundant_experts or 0,
    )
    experts = layer.routed_experts
    keys = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    for param_name, weight_name, physical, shard in experts.get_expert_mapping():
        _, logical, proj, _ = weight_name.split(".")  # "experts.{logical}.{proj}."
        param = getattr(experts, param_name.split(".")[-1] + "weight")
        experts.weight_loader(param, t[f"{logical}.{keys[proj]}"], weight_name + "weight", shard, physical)
    experts.quant_method.process_weights_after_loading(experts)
    return layer


def forward(layer, vcfg, case: MoECase, t: dict[str, torch.Tensor]) -> torch.Tensor:
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, vcfg, num_tokens=case.tokens):
        return layer.forward(t["x"].clone(), t["logits"].clone()).float()


def run_rank(rank: int, world: int, port: int, case: MoECase, moe_backend: str, env: dict[str, str]) -> torch.Tensor:
    """Build a DeepSeek-style MoE layer with TP=world + EP on this rank and return its output.

    With ``--enable-expert-parallel`` and TP=world the EP group is the TP group: every rank holds
    the same tokens and experts/world of the experts; the runner sums over TP at the end.
    """
    os.environ.update(env)
    from vllm.config import set_current_vllm_config

    vcfg = vllm_config(world, moe_backend)
    t = case_tensors(case)
    with set_current_vllm_config(vcfg):
        init_ranks(rank, world, port)
        return forward(build_and_load(case, t), vcfg, case, t)


def reference_moe(case: MoECase) -> torch.Tensor:
    """fp32 reference of the same layer: core's route() + the fp32 reference MoE (no quantisation)."""
    from megamoe_backend.layer import fp32_reference_moe, route
    from megamoe_backend.spec import MoESpec

    t = case_tensors(case)
    spec = MoESpec(hidden_size=case.hidden, moe_intermediate_size=case.inter, n_routed_experts=case.experts,
                   num_experts_per_tok=case.topk, n_group=case.n_group, topk_group=case.topk_group,
                   scoring_func="sigmoid", topk_method="noaux_tc", routed_scaling_factor=case.routed_scaling_factor)
    ids, w = route(t["logits"], spec, t["bias"])
    w1 = torch.stack([torch.cat([t[f"{e}.gate"], t[f"{e}.up"]]) for e in range(case.experts)]).float()
    w2 = torch.stack([t[f"{e}.down"] for e in range(case.experts)]).float()
    return fp32_reference_moe(t["x"], ids, w, w1, w2, gate_up_layout="plain")
