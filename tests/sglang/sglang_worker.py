"""One SGLang process for the engine tests: real sglang 0.5.23 modules, CPU, gloo.

Run as ``python sglang_worker.py SCENARIO RANK WORLD PORT OUT.json``. Every scenario starts the way
an SGLang server process does: ``load_plugins()`` (entry point discovery), ``prepare_server_args``,
``publish`` (which runs resolution), ``initialize_moe_config``, SGLang's own distributed setup
(``init_distributed_environment`` + ``initialize_model_parallel``, gloo instead of NCCL), then
builds SGLang's own ``FusedMoE``, loads DeepSeek-named checkpoint tensors through SGLang's
weight loader and calls its ``forward``. Results go to OUT.json (and tensors to
OUT.pt) for the pytest side to check; nothing here asserts, so a failure is always reported with
the data that caused it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
import time
import traceback
from types import SimpleNamespace

import torch

HIDDEN, INTER, EXPERTS, TOPK = 64, 64, 8, 2


def tokens_for(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-specific tokens and routing (rank r has 5 + r tokens), identical across world sizes."""
    t = 5 + rank
    x = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(10 + rank)).to(torch.bfloat16)
    logits = torch.randn(t, EXPERTS, generator=torch.Generator().manual_seed(20 + rank))
    w, ids = torch.softmax(logits, -1).topk(TOPK, dim=-1)
    return x, ids, w


def start_sglang(rank: int, world: int, port: int, extra: list[str]) -> dict:
    t0 = time.perf_counter()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", "dummy", "--device", "cpu", "--tp", str(world), "--ep-size", str(world)]
    if world > 1:
        argv += ["--attn-dp-size", str(world)]
    server_args = prepare_server_args(argv + extra)
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=rank))
    initialize_moe_config()
    init_distributed_environment(
        world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank, backend="gloo"
    )
    initialize_model_parallel(backend="gloo")
    return {"startup_s": time.perf_counter() - t0}


def all_experts(fmt: str):
    """Every expert's weights, fp32 masters [E, 2I, H] (gate rows then up) and [E, H, I], plus the
    checkpoint tensors (DeepSeek names, per expert) in ``fmt``: "bf16" or "mxfp4" (Quark layout)."""
    from megamoe_backend.formats import quantize_mx

    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.1
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.1
    ckpt = {}
    for e in range(EXPERTS):
        for proj, w in (("gate_proj", w13[e, :INTER]), ("up_proj", w13[e, INTER:]), ("down_proj", w2[e])):
            name = f"model.layers.3.mlp.experts.{e}.{proj}."
            if fmt == "bf16":
                ckpt[name + "weight"] = w.to(torch.bfloat16)
            else:
                q = quantize_mx(w, "fp4")
                ckpt[name + "weight"], ckpt[name + "weight_scale"] = q.data, q.scales
    return w13, w2, ckpt


def load_like_sglang(layer, ckpt: dict) -> int:
    """DeepSeek's expert loading loop: FusedMoE.make_expert_params_mapping + the param weight_loader
    (which skips experts this EP rank does not own), then process_weights_after_loading."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", EXPERTS)
    params = dict(layer.named_parameters(prefix="model.layers.3.mlp.experts"))
    loaded = 0
    for name, tensor in ckpt.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            target = name.replace(weight_name, param_name).replace("experts.experts.", "experts.")
            param = params[target]
            param.weight_loader(param, tensor, target, shard_id=shard_id, expert_id=expert_id)
            loaded += 1
            break
    layer.quant_method.process_weights_after_loading(layer)
    return loaded


def core_reference(x, ids, w, weights_fmt: str, quant: str, w13, w2):
    """The same tokens through megamoe_backend alone (ep_size 1, all experts): the core reference."""
    from megamoe_backend.experts import interleave_gate_up, quantize_expert_weights
    from megamoe_backend.knobs import Knobs
    from megamoe_backend.layer import MegaMoELayer
    from megamoe_backend.plan import build_plan
    from megamoe_backend.spec import MoESpec

    spec = MoESpec(hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=EXPERTS, num_experts_per_tok=TOPK,
                   quant=quant)
    weights = quantize_expert_weights(interleave_gate_up(w13), w2, weights_fmt)
    plan = build_plan(spec, Knobs.from_env(), 0, 1, device_type="cpu")
    return MegaMoELayer(plan, weights, group=None).forward(x, ids, w)


def sglang_quant(fmt: str):
    """(SGLang quant config, MegaMoE quant scheme): none / bf16, or Quark MXFP4 A4W4 from the R1 fixture."""
    if fmt != "mxfp4":
        return None, "bf16"
    from sglang.srt.layers.quantization.quark.quark import QuarkConfig

    qc = json.loads((Path(__file__).parent.parent / "fixtures" / "r1_mxfp4_config.json").read_text())["quantization_config"]
    return QuarkConfig.from_config({**qc, "packed_modules_mapping": {}}), "a4w4"


def reference_weights(fmt: str, w13, w2):
    """The fp32 weights MegaMoE actually holds: MXFP4-dequantised, or bf16-rounded."""
    if fmt == "mxfp4":
        from megamoe_backend.formats import dequantize_mx, quantize_mx

        return dequantize_mx(quantize_mx(w13, "fp4")), dequantize_mx(quantize_mx(w2, "fp4"))
    return w13.to(torch.bfloat16).float(), w2.to(torch.bfloat16).float()


def forward_scenario(rank: int, world: int, fmt: str) -> dict:
    """SGLang FusedMoE built with SGLang's quant method (unquantised, or Quark MXFP4 A4W4 from the
    R1 MXFP4 fixture's quantization_config), loaded through SGLang's loader, forward via megamoe_ep."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    from megamoe_backend.layer import fp32_reference_moe, rel_l2
    from megamoe_sglang.dispatcher import MegaMoEDispatcher

    quant_config, quant = sglang_quant(fmt)
    layer = FusedMoE(
        num_experts=EXPERTS, top_k=TOPK, hidden_size=HIDDEN, intermediate_size=INTER, layer_id=3,
        params_dtype=torch.bfloat16, reduce_results=False, quant_config=quant_config, prefix="model.layers.3.mlp.experts",
    )
    w13, w2, ckpt = all_experts(fmt)
    loaded = load_like_sglang(layer, ckpt)
    released = all(p.numel() == 0 for p in layer.parameters())
    x, ids, w = tokens_for(rank)
    topk = StandardTopKOutput(w, ids.to(torch.int32), torch.zeros(len(x), EXPERTS))
    t0 = time.perf_counter()
    out = layer.forward(x, topk)
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out2 = layer.forward(x, topk)
    t_second = time.perf_counter() - t0
    w13_ref, w2_ref = reference_weights(fmt, w13, w2)
    ref = fp32_reference_moe(x, ids, w, w13_ref, w2_ref, gate_up_layout="plain")
    core = core_reference(x, ids, w, "bf16" if fmt == "bf16" else "mxfp4", quant, w13_ref if fmt == "bf16" else w13, w2_ref if fmt == "bf16" else w2)
    runtime = layer._megamoe_ep[1].runtime
    wire_mismatch = None
    if fmt == "bf16":  # an fp4 dispatch wire cannot feed bf16 experts: refused when weights load
        import os

        other = FusedMoE(num_experts=EXPERTS, top_k=TOPK, hidden_size=HIDDEN, intermediate_size=INTER, layer_id=4,
                         params_dtype=torch.bfloat16, reduce_results=False, quant_config=None,
                         prefix="model.layers.4.mlp.experts")
        os.environ["MEGA_DISPATCH_WIRE"] = "fp4"
        try:
            other.quant_method.process_weights_after_loading(other)
        except Exception as exc:  # recorded for the test
            wire_mismatch = f"{type(exc).__name__}: {exc}"
        finally:
            os.environ.pop("MEGA_DISPATCH_WIRE")
    return {
        "wire_mismatch_error": wire_mismatch,
        "a2a_enum": str(get_moe_a2a_backend()),
        "dispatcher": type(layer.dispatcher).__name__,
        "is_megamoe_dispatcher": isinstance(layer.dispatcher, MegaMoEDispatcher),
        "quant_method": type(layer.quant_method).__name__,
        "scheme": type(getattr(layer, "scheme", None)).__name__,
        "plan_quant": runtime.plan.math.quant,
        "wire": runtime.plan.dispatch.name,
        "tensors_loaded": loaded,
        "sglang_params_released": released,
        "converted_copy_released": getattr(layer, "_megamoe_weights", "missing") is None,
        "num_local_experts": layer.num_local_experts,
        "ep_rank": int(layer.moe_ep_rank),
        "transport": runtime.transport.name,
        "rel_l2_vs_fp32_reference": rel_l2(out, ref),
        "equal_to_core_layer": bool(torch.equal(out, core)),
        "rel_l2_vs_core_layer": rel_l2(out, core),
        "repeat_equal": bool(torch.equal(out, out2)),
        "out_shape": list(out.shape),
        "out_dtype": str(out.dtype),
        "first_forward_s": t_first,
        "second_forward_s": t_second,
        "_tensors": {"out": out},
    }


FP8_HIDDEN, FP8_INTER = 256, 128  # whole 128 x 128 blocks (the fp8 scenario's own shapes)


def block_fp8_experts():
    """Every expert's block-FP8 weights as DeepSeek V3 / R1 FP8 stores them (e4m3 + fp32 weight_scale_inv per
    128 x 128 block, gate_proj / up_proj / down_proj per expert): (ExpertWeights, checkpoint tensors)."""
    from megamoe_backend.experts import ExpertWeights
    from megamoe_backend.formats.block_fp8 import quantize_weight_blocks

    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * FP8_INTER, FP8_HIDDEN, generator=g) * 0.1
    w2 = torch.randn(EXPERTS, FP8_HIDDEN, FP8_INTER, generator=g) * 0.1
    (q13, s13), (q2, s2) = quantize_weight_blocks(w13, "w13"), quantize_weight_blocks(w2, "w2")
    blocks = FP8_INTER // 128
    ckpt = {}
    for e in range(EXPERTS):
        for proj, q, s in (("gate_proj", q13[e, :FP8_INTER], s13[e, :blocks]), ("up_proj", q13[e, FP8_INTER:], s13[e, blocks:]),
                           ("down_proj", q2[e], s2[e])):
            name = f"model.layers.3.mlp.experts.{e}.{proj}."
            ckpt[name + "weight"], ckpt[name + "weight_scale_inv"] = q.contiguous(), s.contiguous()
    return ExpertWeights(q13, q2, "fp8_block", "plain", s13, s2), ckpt


def forward_block_fp8_scenario(rank: int, world: int) -> dict:
    """SGLang's FusedMoE with SGLang's Fp8Config (the DeepSeek V3 FP8 fixture's quantization_config: block
    128 x 128) -> SGLang's Fp8MoEMethod, its parameters and weight loader; forward via megamoe_ep."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from megamoe_backend.knobs import Knobs
    from megamoe_backend.layer import MegaMoELayer, fp32_reference_moe, rel_l2
    from megamoe_backend.plan import build_plan
    from megamoe_backend.spec import MoESpec

    qc = json.loads((Path(__file__).parent.parent / "fixtures" / "deepseek_v3_fp8_config.json").read_text())
    layer = FusedMoE(
        num_experts=EXPERTS, top_k=TOPK, hidden_size=FP8_HIDDEN, intermediate_size=FP8_INTER, layer_id=3,
        params_dtype=torch.bfloat16, reduce_results=False, quant_config=Fp8Config.from_config(qc["quantization_config"]),
        prefix="model.layers.3.mlp.experts",
    )
    weights, ckpt = block_fp8_experts()
    loaded = load_like_sglang(layer, ckpt)
    released = all(p.numel() == 0 for p in layer.parameters())
    t = 5 + rank
    x = torch.randn(t, FP8_HIDDEN, generator=torch.Generator().manual_seed(10 + rank)).to(torch.bfloat16)
    w, ids = torch.softmax(torch.randn(t, EXPERTS, generator=torch.Generator().manual_seed(20 + rank)), -1).topk(TOPK, -1)
    out = layer.forward(x, StandardTopKOutput(w, ids.to(torch.int32), torch.zeros(t, EXPERTS)))
    spec = MoESpec(hidden_size=FP8_HIDDEN, moe_intermediate_size=FP8_INTER, n_routed_experts=EXPERTS,
                   num_experts_per_tok=TOPK, quant="fp8_block")
    core = MegaMoELayer(build_plan(spec, Knobs.from_env(), 0, 1, device_type="cpu"), weights, group=None).forward(x, ids, w)
    ref = fp32_reference_moe(x, ids, w, *weights.dequantized(), gate_up_layout="plain")
    runtime = layer._megamoe_ep[1].runtime
    return {
        "quant_method": type(layer.quant_method).__name__,
        "plan_quant": runtime.plan.math.quant,
        "wire": runtime.plan.dispatch.name,
        "startup_line": runtime.plan.startup_line() if hasattr(runtime.plan, "startup_line") else None,
        "tensors_loaded": loaded,
        "sglang_params_released": released,
        "ep_rank": int(layer.moe_ep_rank),
        "num_local_experts": layer.num_local_experts,
        "transport": runtime.transport.name,
        "equal_to_core_layer": bool(torch.equal(out, core)),
        "rel_l2_vs_core_layer": rel_l2(out, core),
        "rel_l2_vs_fp32_reference": rel_l2(out, ref),
        "out_shape": list(out.shape),
        "out_dtype": str(out.dtype),
        "_tensors": {"out": out},
    }


EPLB_LAYER = 3


def eplb_scenario(rank: int, world: int, fmt: str = "bf16", redundant: int = 2) -> dict:
    """--enable-eplb --ep-num-redundant-experts 2: SGLang's ExpertLocationMetadata (init_trivial) places
    10 physical experts, SGLang's loader fills every replica, SGLang's dispatch ("static": a replica on
    this rank when there is one) maps logical -> physical ids; then SGLang's own rebalance (init_by_eplb on a skewed load) and ExpertLocationUpdater move
    the experts between the ranks over gloo. Every output is compared with the run without redundancy
    (the core layer on logical ids) and the fp32 reference. ``fmt`` "mxfp4": Quark A4W4 (scales move too). The model config (DeepSeek, 8 experts, 61
    layers) comes from MEGAMOE_TEST_MODEL; the server runs with --model-path dummy (see start_sglang)."""
    import os
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import (ExpertLocationMetadata, get_global_expert_location_metadata,
                                                 set_global_expert_location_metadata)
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo, topk_ids_logical_to_physical
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.models.deepseek_v2 import DeepseekV2MoE

    from megamoe_backend.layer import fp32_reference_moe, rel_l2

    model_config = ModelConfig(os.environ["MEGAMOE_TEST_MODEL"], trust_remote_code=False)
    set_global_expert_location_metadata(ExpertLocationMetadata.init_trivial(model_config, moe_ep_rank=rank))
    physical = EXPERTS + redundant
    quant_config, quant = sglang_quant(fmt)
    layer = FusedMoE(num_experts=physical, top_k=TOPK, hidden_size=HIDDEN, intermediate_size=INTER, layer_id=EPLB_LAYER,
                     params_dtype=torch.bfloat16, reduce_results=False, quant_config=quant_config,
                     prefix=f"model.layers.{EPLB_LAYER}.mlp.experts")
    w13, w2, ckpt = all_experts(fmt)
    load_like_sglang(layer, ckpt)
    w13_ref, w2_ref = reference_weights(fmt, w13, w2)
    # the core layer quantises the fp32 masters itself (MXFP4), or takes the bf16-rounded ones
    core_w13, core_w2 = (w13, w2) if fmt == "mxfp4" else (w13_ref, w2_ref)
    g = torch.Generator().manual_seed(30 + rank)
    x = torch.randn(16, HIDDEN, generator=g).to(torch.bfloat16)
    w, logical_ids = torch.softmax(torch.randn(16, EXPERTS, generator=g), -1).topk(TOPK, dim=-1)
    sweep_ids = torch.arange(2 * physical).view(physical, 2) % physical  # every physical slot, twice
    x_sweep = torch.randn(physical, HIDDEN, generator=g).to(torch.bfloat16)
    w_sweep = torch.rand(physical, TOPK, generator=g)

    def forward(x_, physical_ids, w_):
        return layer.forward(x_, StandardTopKOutput(w_, physical_ids.to(torch.int32), torch.zeros(len(x_), EXPERTS)))

    def check(tag: str) -> dict:
        """This rank's tokens through SGLang's dispatch map, and the all-slots sweep, vs the run
        without redundancy (bit for bit) and the fp32 reference."""
        p2l = get_global_expert_location_metadata().physical_to_logical_map_cpu[EPLB_LAYER]
        phys = topk_ids_logical_to_physical(logical_ids, ExpertLocationDispatchInfo.init_new(layer_id=EPLB_LAYER))
        out, out_sweep = forward(x, phys, w), forward(x_sweep, sweep_ids, w_sweep)
        core = core_reference(x, logical_ids, w, "bf16" if fmt == "bf16" else "mxfp4", quant, core_w13, core_w2)
        core_sweep = core_reference(x_sweep, p2l[sweep_ids], w_sweep, "bf16" if fmt == "bf16" else "mxfp4", quant,
                                    core_w13, core_w2)
        ref = fp32_reference_moe(x, logical_ids, w, w13_ref, w2_ref, gate_up_layout="plain")
        return {
            f"{tag}_map": p2l.tolist(),
            f"{tag}_physical_ids_valid": bool(torch.equal(p2l[phys.long()], logical_ids)),
            f"{tag}_physical_ids_used": sorted(set(phys.flatten().tolist())),
            f"{tag}_equal_to_core": bool(torch.equal(out, core)),
            f"{tag}_sweep_equal_to_core": bool(torch.equal(out_sweep, core_sweep)),
            f"{tag}_rel_l2_vs_fp32_reference": rel_l2(out, ref),
        }

    result = check("initial")
    runtime = layer._megamoe_ep[1].runtime
    # DeepseekV2MoE.get_moe_weights is what SGLang's model hands the updater; its self is only read for these two
    moe_weights = DeepseekV2MoE.get_moe_weights(SimpleNamespace(experts=layer, num_fused_shared_experts=0))
    megamoe = runtime.expert_tensors()
    logical_count = torch.ones(model_config.num_hidden_layers, EXPERTS)
    logical_count[EPLB_LAYER, 5], logical_count[EPLB_LAYER, 6] = 60.0, 40.0
    new_meta = ExpertLocationMetadata.init_by_eplb(model_config, logical_count=logical_count)
    updater = ExpertLocationUpdater()
    updater._first_execution = False  # its first call empties the accelerator's cache; torch.cpu has none
    updater.update({EPLB_LAYER: moe_weights}, new_meta, update_layer_ids=[EPLB_LAYER], nnodes=1, rank=rank)
    result.update(check("moved"))
    result.update({
        "startup_line": runtime.plan.startup_line(),
        "num_local_experts": layer.num_local_experts,
        "moe_weights": [(list(t.shape), t.is_contiguous(), t.data_ptr()) for t in moe_weights],
        "megamoe_tensors": {name: (list(t.shape), t.data_ptr()) for name, t in megamoe.items()},
    })
    return result


def record_bounds() -> list[dict]:
    """A pass-through around ``MegaMoELayer.forward``: after the real forward returned, note the
    tokens it got, the ``max_tokens_across_ranks`` it received and which forward ran it. Nothing is
    changed: the plugin's runner decides whether to pass a bound (``token_bound.takes_token_bound``)
    and the layer's torch forward checks it against both ranks' numbers (its dispatch header), so a
    record is a bound the real forward took and accepted."""
    from megamoe_backend.layer import MegaMoELayer

    calls: list[dict] = []
    inner = MegaMoELayer.forward

    def forward(self, x, topk_ids, topk_weights, output_scale=1.0, out=None, max_tokens_across_ranks=None):
        result = inner(self, x, topk_ids, topk_weights, output_scale, out, max_tokens_across_ranks)
        calls.append({"tokens": int(x.shape[0]), "bound": max_tokens_across_ranks, "forward": type(self.path).__name__})
        return result

    MegaMoELayer.forward = forward
    return calls


class SchedulerSide:
    """SGLang's DP bookkeeping for one step, run by SGLang's own functions, from this rank's batch:

    the scheduler's ``prepare_mlp_sync_batch_raw`` (the DP all-gather of every rank's token count
    over the TP group's CPU group, the idle batch for a rank without work — SGLang's own
    ``ScheduleBatch.init_new([]) + prepare_for_idle()`` — and ``_update_gather_batch``), then
    ``ForwardBatch.prepare_mlp_sync_batch`` (the DP padding mode — SUM_LEN for extend, MAX_LEN for
    decode — the padded per-rank counts, this rank's padded batch, and ``set_dp_buffer_len`` that
    publishes them for the MoE). What stands in for the scheduler's state: the local batch (mode,
    requests, lengths: ``local_batch``), the model runner's few answers (no prefill graph runner,
    the attention backend's padding value), the graph config SGLang resolves for a real model
    (its defaults; the dummy model stops resolution before that step), and the CPU-engine flag
    (``SGLANG_USE_CPU_ENGINE=1`` needs sgl_kernel's CPU ops, not installable here; it only turns
    pinned memory off)."""

    def __init__(self, model_config) -> None:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.runner = SimpleNamespace(
            attn_backend=SimpleNamespace(folds_encoder_swa_replay=False, late_layer_num_tokens=lambda fb: None,
                                         get_cpu_graph_seq_len_fill_value=lambda: 1),
            prefill_cuda_graph_runner=None, spec_algorithm=SpeculativeAlgorithm.NONE, model_config=model_config,
            is_draft_worker=False, attn_tp_sequence_sharded=lambda num_tokens: False)

    def idle_batch(self):
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        batch = ScheduleBatch.init_new([], SimpleNamespace(device="cpu"), None, None, self.runner.model_config, False,
                                       self.runner.spec_algorithm)
        batch.prepare_for_idle()
        return batch

    @staticmethod
    def local_batch(mode: str, lengths: list[int]):
        """This rank's scheduled batch: ``lengths`` = each request's new tokens (extend) or its
        sequence length (decode, one new token each); None: nothing scheduled here."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        if not lengths:
            return None
        if mode == "extend":
            return SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=[], spec_info=None, encoder_swa_reset=None,
                                   batch_size=lambda: len(lengths), extend_num_tokens=sum(lengths), extend_lens=lengths,
                                   extend_logprob_start_lens=[n - 1 for n in lengths], return_logprob=False,
                                   prefix_lens=[0] * len(lengths), seq_lens=torch.tensor(lengths),
                                   input_ids=torch.zeros(sum(lengths), dtype=torch.int64))
        seq = torch.tensor(lengths)
        return SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=[], spec_info=None, batch_size=lambda: len(lengths),
                               seq_lens_cpu=seq, seq_lens=seq, prefix_lens=[],
                               input_ids=torch.zeros(len(lengths), dtype=torch.int64))

    def step(self, mode: str, lengths: list[int]) -> dict:
        """The scheduler's sync and the forward batch's padding for this step; returns what the MoE
        input of this rank is (its padded token count) and what SGLang decided."""
        from sglang.srt.layers.dp_attention import get_dp_global_num_tokens
        from sglang.srt.managers.scheduler_components.dp_attn import prepare_mlp_sync_batch_raw
        from sglang.srt.model_executor import forward_batch_info
        from sglang.srt.model_executor.cuda_graph_config import default_cuda_graph_config
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.runtime_context import get_exec
        from sglang.srt.utils.common import require_mlp_tp_gather

        batch = prepare_mlp_sync_batch_raw(
            self.local_batch(mode, lengths), model_runner=self.runner, get_idle_batch=self.idle_batch,
            disable_cuda_graph=True, require_mlp_tp_gather=require_mlp_tp_gather(), disable_overlap_schedule=True,
            offload_tags=set())
        tokens = int(batch.input_ids.shape[0])
        seq = batch.seq_lens if len(batch.seq_lens) else torch.zeros(0, dtype=torch.int64)
        fb = ForwardBatch(
            forward_mode=batch.forward_mode, batch_size=batch.batch_size(), input_ids=batch.input_ids,
            req_pool_indices=torch.arange(batch.batch_size()), seq_lens=seq, out_cache_loc=torch.zeros(tokens, dtype=torch.int64),
            seq_lens_sum=int(seq.sum()), positions=torch.zeros(tokens, dtype=torch.int64), seq_lens_cpu=seq,
            extend_num_tokens=getattr(batch, "extend_num_tokens", None),
            global_num_tokens_cpu=batch.global_num_tokens, global_num_tokens_for_logprob_cpu=batch.global_num_tokens_for_logprob,
            global_num_tokens_gpu=torch.zeros(len(batch.global_num_tokens), dtype=torch.int64),
            is_extend_in_batch=batch.is_extend_in_batch, can_run_dp_prefill_cuda_graph=batch.can_run_dp_prefill_cuda_graph,
            tbo_split_seq_index=batch.tbo_split_seq_index)
        saved, forward_batch_info._is_cpu = forward_batch_info._is_cpu, True
        try:
            with get_exec().graph.override(cuda_graph_config=default_cuda_graph_config()):
                fb.prepare_mlp_sync_batch(self.runner)
        finally:
            forward_batch_info._is_cpu = saved
        return {"mode": batch.forward_mode.name, "gathered": list(batch.global_num_tokens),
                "padding": fb.dp_padding_mode.name, "published": list(get_dp_global_num_tokens()),
                "moe_tokens": int(fb.input_ids.shape[0])}


def bound_scenario(rank: int, world: int) -> dict:
    """Issue 32's token bound through SGLang's own DP bookkeeping, 2 DP ranks (SchedulerSide): for
    each step every rank runs SGLang's scheduler sync and forward-batch padding, then the MoE
    (SGLang's FusedMoE.forward -> the megamoe_ep runner -> MegaMoELayer.forward) on its padded batch.

    Steps (rank 0 | rank 1): extend 3 | 17 tokens; extend 5 | nothing (rank 1 runs SGLang's idle
    batch: 0 tokens); decode 2 | 1 requests; decode 3 | nothing (the idle batch, padded to rank 0's
    3 by MAX_LEN); then the counts SGLang's graph runner publishes when it captures a batch of 8
    (base_runner: ``[num_tokens] * num_dp_ranks`` when ``require_mlp_tp_gather()``) and that padded
    batch. Also: the runtime exists once the weights are loaded."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.dp_attention import set_dp_buffer_len
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.managers.scheduler_components.dp_attn import MLPSyncBatchInfo, _update_gather_batch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.common import require_mlp_tp_gather
    import os

    layer = FusedMoE(num_experts=EXPERTS, top_k=TOPK, hidden_size=HIDDEN, intermediate_size=INTER, layer_id=3,
                     params_dtype=torch.bfloat16, reduce_results=False, quant_config=None,
                     prefix="model.layers.3.mlp.experts")
    load_like_sglang(layer, all_experts("bf16")[2])
    built_at_load = getattr(layer, "_megamoe_ep", None) is not None
    calls = record_bounds()
    parallel = get_parallel()
    sched = SchedulerSide(ModelConfig(os.environ["MEGAMOE_TEST_MODEL"], trust_remote_code=False))

    def moe(tokens: int) -> None:
        g = torch.Generator().manual_seed(40 + rank + tokens)
        x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
        w, ids = torch.softmax(torch.randn(tokens, EXPERTS, generator=g), -1).topk(TOPK, dim=-1)
        layer.forward(x, StandardTopKOutput(w, ids.to(torch.int32), torch.zeros(tokens, EXPERTS)))

    def unhooked_gather(tokens: int) -> list[int]:
        """What the scheduler would keep for a CUSTOMIZED a2a backend without the plugin's hook."""
        info = MLPSyncBatchInfo(num_dp_ranks=parallel.num_dp_ranks, tp_size=parallel.attn_tp_size,
                                cp_size=parallel.attn_cp_size, num_tokens=tokens, num_tokens_for_logprob=tokens,
                                can_run_decode_cuda_graph=False, can_run_draft_cuda_graph=False,
                                can_run_prefill_cuda_graph=False, is_extend_in_batch=True, local_can_run_tbo=False,
                                local_forward_mode=ForwardMode.EXTEND.value)
        info.all_gather(device="cpu", group=parallel.tp_group.cpu_group)
        batch = SimpleNamespace()
        _update_gather_batch(batch, info, False)
        return list(batch.global_num_tokens)

    plan = [("extend", ([3], [17])), ("extend", ([5], [])), ("decode", ([9, 12], [7])), ("decode", ([9, 12, 4], []))]
    steps = []
    for mode, lengths in plan:
        step = sched.step(mode, lengths[rank])
        moe(step["moe_tokens"])
        steps.append(step)
    graph_bs = 8
    captured = [graph_bs] * parallel.num_dp_ranks if require_mlp_tp_gather() else [graph_bs]
    set_dp_buffer_len(sum(captured), graph_bs, True, captured)
    moe(graph_bs)
    return {
        "runtime_built_at_load": built_at_load,
        "require_mlp_tp_gather": require_mlp_tp_gather(),
        "steps": steps,
        "unhooked_gathered": unhooked_gather((3, 17)[rank]),
        "calls": calls,
    }


SCENARIOS = {
    "forward_bf16": lambda r, w: forward_scenario(r, w, "bf16"),
    "forward_mxfp4": lambda r, w: forward_scenario(r, w, "mxfp4"),
    "forward_block_fp8": forward_block_fp8_scenario,
    "eplb_bf16": eplb_scenario,
    "eplb_mxfp4": lambda r, w: eplb_scenario(r, w, "mxfp4"),
    "bound": bound_scenario,
}


def main() -> None:
    scenario, rank, world, port, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    extra = sys.argv[6:]
    result: dict = {"scenario": scenario, "rank": rank, "world": world}
    try:
        result.update(start_sglang(rank, world, port, extra))
        result.update(SCENARIOS[scenario](rank, world))
        result["ok"] = True
    except BaseException:
        result["ok"] = False
        result["error"] = traceback.format_exc()
    tensors = result.pop("_tensors", {})
    if tensors:
        torch.save(tensors, out_path.replace(".json", ".pt"))
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
