"""vLLM EPLB at the layer level: redundant experts from vLLM's initial map, a rearrangement by vLLM's
own policy and mover, over gloo — one rank's body (``run_rank_eplb``), imported by test_layer_ep.

What is vLLM's and what is not:
- vLLM's: the layer objects built with ``enable_eplb`` + ``num_redundant_experts``, the loader's
  physical -> logical mapping (``get_expert_mapping``), ``get_expert_weights()``, the router state
  (``set_eplb_state`` with ``compute_logical_maps``), the new map (``DefaultEplbPolicy``), the move
  (``rearrange_expert_weights_inplace`` with ``create_eplb_communicator``: isend/irecv over the EP
  group's CPU (gloo) group, then in-place copies into the ``get_expert_weights()`` views).
- Not vLLM's: the router's logical -> physical id mapping. vLLM defines ``eplb_map_to_physical_and_record``
  only on CUDA / XPU (a Triton kernel; on CPU it returns the logical ids unchanged), so
  ``kernel_rule_map`` below is a torch transcription of that kernel's rule (vllm 0.32.0,
  router/base_router.py ``_eplb_map_and_record_i32_kernel``), installed in its place.
- ParallelConfig's "EPLB only on CUDA/ROCm/XPU" validation is passed by switching EPLB on after
  it (``layer_harness.vllm_config``); vLLM's engine cannot be started with EPLB on CPU at all.
"""

from __future__ import annotations

import os

import torch
from layer_harness import MoECase, build_and_load, case_tensors, forward, init_ranks, vllm_config

KNUTH_MULTIPLIER = 2654435769  # the kernel's floor(2^32 / phi)


def kernel_rule_map(topk_ids, expert_load_view, logical_to_physical_map, logical_replica_count, record_enabled,
                    num_unpadded_tokens=None):
    """vLLM's CUDA kernel rule in torch: token i's logical expert e goes to replica
    ((i * 2654435769) mod 2^32) mod replicas(e); valid picks add 1 to that physical expert's load."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    k = topk_ids.shape[-1]
    valid = (flat >= 0) & (flat < logical_replica_count.shape[0])
    safe = torch.where(valid, flat, torch.zeros_like(flat))
    replicas = logical_replica_count[safe].to(torch.int64).clamp_min(1)
    token = torch.arange(flat.numel(), dtype=torch.int64) // k
    replica = ((token * KNUTH_MULTIPLIER) & 0xFFFFFFFF) % replicas
    physical = torch.where(valid, logical_to_physical_map[safe, replica].to(torch.int64), torch.full_like(flat, -1))
    if bool(record_enabled):
        rows = physical >= 0
        if num_unpadded_tokens is not None:
            rows &= torch.arange(flat.numel()) < int(num_unpadded_tokens) * k
        expert_load_view.index_add_(0, physical[rows], torch.ones(int(rows.sum()), dtype=expert_load_view.dtype))
    return physical.view(topk_ids.shape).to(topk_ids.dtype)


def _install_router_state(layer, p2l: torch.Tensor, num_logical: int, load: torch.Tensor, tokens: int) -> None:
    """What EplbState.add_model does for one layer: the router's maps, load view and record flag."""
    from vllm.distributed.eplb.eplb_state import compute_logical_maps

    l2p, replicas = compute_logical_maps(p2l.unsqueeze(0), num_logical)
    layer.set_eplb_state(0, load, l2p, replicas)
    state = layer.eplb_state
    state.should_record_tensor = torch.tensor(True)
    state.num_unpadded_tokens_tensors = [torch.tensor(tokens)]


def run_rank_eplb(rank: int, world: int, port: int, case: MoECase, redundant: int, env: dict[str, str]) -> dict:
    """Initial redundant placement -> forward -> vLLM's rearrangement -> forward; what the test checks."""
    os.environ.update(env)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_ep_group
    from vllm.distributed.eplb.eplb_communicator import create_eplb_communicator
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace
    from vllm.model_executor.layers.fused_moe.router import base_router

    base_router.eplb_map_to_physical_and_record = kernel_rule_map
    vcfg = vllm_config(world, "megamoe_ep", redundant)
    t = case_tensors(case)
    num_physical = case.experts + redundant
    with set_current_vllm_config(vcfg):
        init_ranks(rank, world, port)
        layer = build_and_load(case, t, redundant)
        experts = layer.routed_experts
        runtime = experts.quant_method.runtime
        p2l = torch.tensor(EplbState.build_initial_global_physical_to_logical_map(case.experts, redundant))
        load = torch.zeros(1, num_physical, dtype=torch.int64)
        _install_router_state(layer, p2l, case.experts, load, case.tokens)
        expert_weights = list(experts.get_expert_weights())  # vLLM's EPLB view of the layer
        megamoe_tensors = runtime.expert_tensors()
        out_initial = forward(layer, vcfg, case, t)

        # vLLM's policy picks a new map for a skewed load (logical 5 and 6 hot), vLLM's mover moves the experts
        logical_load = torch.ones(1, case.experts)
        logical_load[0, 5], logical_load[0, 6] = 60.0, 40.0
        new_p2l = DefaultEplbPolicy.rebalance_experts(logical_load, num_physical, case.n_group, 1, world, p2l.unsqueeze(0))
        buffers = [torch.empty_like(w) for w in expert_weights]
        communicator = create_eplb_communicator(get_ep_group(), "torch_nccl", [expert_weights], buffers)
        rearrange_expert_weights_inplace(p2l.unsqueeze(0), new_p2l, [expert_weights], buffers,
                                         get_ep_group().device_group, communicator)
        _install_router_state(layer, new_p2l[0], case.experts, torch.zeros_like(load), case.tokens)
        out_moved = forward(layer, vcfg, case, t)
    return {
        "supports_eplb": experts.quant_method.supports_eplb,
        "startup_line": runtime.plan.startup_line(),
        "placement_logical": list(runtime.plan.placement.logical_of_physical),
        "initial_map": p2l.tolist(),
        "new_map": new_p2l[0].tolist(),
        "eplb_views": [(tuple(w.shape), w.is_contiguous(), w.data_ptr()) for w in expert_weights],
        "megamoe_tensors": {name: (tuple(x.shape), x.data_ptr()) for name, x in megamoe_tensors.items()},
        "local_experts": experts.local_num_experts,
        "physical_load": load[0].tolist(),
        "out_initial": out_initial.numpy(),  # numpy: a torch tensor in a Queue outlives its process badly
        "out_moved": out_moved.numpy(),
    }
