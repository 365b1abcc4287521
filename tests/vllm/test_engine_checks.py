"""vLLM start-up refusals and the token bound's reader, on vLLM's own config and forward-context
objects (no engine): --enable-dbo / --ubatch-size, CUDA-graph capture of an uncapturable layer, and
``max_tokens_across_ranks`` from ``DPMetadata`` (the engine run: test_serve.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import megamoe_vllm
from megamoe_backend.knobs import Knobs
from megamoe_backend.plan import build_plan
from megamoe_backend.plan.capture import GraphCaptureError
from megamoe_backend.spec import preset
from megamoe_vllm.dp_bound import max_tokens_across_ranks
from megamoe_vllm.engine_checks import (
    MegaMoEConfigError, check_no_microbatching, engine_captures_graphs, engine_graphs,
)


@pytest.fixture(scope="module", autouse=True)
def registered():
    megamoe_vllm.register()


def _parsed(*argv: str):
    """EngineArgs exactly as ``vllm serve ARGV`` parses them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--moe-backend", "megamoe_ep", *argv]))


def _parallel_config(*argv: str):
    """vLLM's ParallelConfig from the parsed flags (the fields create_engine_config passes). vLLM's
    CPU platform switches DBO off later, in create_engine_config; on GPUs it stays on."""
    from vllm.config import ParallelConfig

    a = _parsed(*argv)
    return ParallelConfig(data_parallel_size=a.data_parallel_size, enable_expert_parallel=a.enable_expert_parallel,
                          enable_dbo=a.enable_dbo, ubatch_size=a.ubatch_size, all2all_backend=a.all2all_backend)


DP_EP = ("--data-parallel-size", "2", "--enable-expert-parallel")


@pytest.mark.parametrize("argv, needle", [
    (("--enable-dbo", "--all2all-backend", "deepep_low_latency"), "Drop --enable-dbo"),
    (("--ubatch-size", "2", "--all2all-backend", "deepep_high_throughput"), r"micro-batching \(--ubatch-size 2\)"),
])
def test_microbatching_is_refused_naming_the_flag(argv, needle):
    pc = _parallel_config(*DP_EP, *argv)
    assert pc.use_ubatching  # vLLM itself would run two micro-batches
    with pytest.raises(MegaMoEConfigError, match=needle):
        check_no_microbatching(pc)
    check_no_microbatching(_parallel_config(*DP_EP))  # the supported deployment passes
    check_no_microbatching(_parallel_config(*DP_EP, "--ubatch-size", "1"))


def test_routed_experts_refuse_dbo_at_construction():
    """The refusal is wired where vLLM builds every MoE layer: MegaMoERoutedExperts.__init__."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    from megamoe_vllm.routed_experts import MegaMoERoutedExperts

    vcfg = VllmConfig(parallel_config=ParallelConfig(data_parallel_size=2, enable_expert_parallel=True))
    vcfg.parallel_config.enable_dbo = True  # after validation: vLLM's CPU platform would switch it off
    vcfg.parallel_config.all2all_backend = "deepep_low_latency"
    mpc = SimpleNamespace(dp_size=2, tp_size=1, pcp_size=1, use_ep=True)
    moe_config = SimpleNamespace(moe_backend="megamoe_ep", moe_parallel_config=mpc, max_num_tokens=256,
                                 activation=SimpleNamespace(is_gated=True, value="silu"), has_bias=False,
                                 is_lora_enabled=False)
    with set_current_vllm_config(vcfg), pytest.raises(MegaMoEConfigError, match="--enable-dbo"):
        MegaMoERoutedExperts("model.layers.1.mlp.experts", torch.bfloat16, moe_config)


@pytest.fixture(scope="module")
def engine_configs(tiny_models):
    """VllmConfig of ``vllm serve`` with and without --enforce-eager (vLLM's own config objects)."""
    from vllm.config import CUDAGraphMode

    out = {}
    for name, extra in (("default", ()), ("eager", ("--enforce-eager",))):
        cfg = _parsed("--model", str(tiny_models["bf16"]), *DP_EP, *extra).create_engine_config()
        # vLLM's CPU platform sets NONE (it captures nothing); a GPU keeps its default mode
        cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        out[name] = cfg
    return out


def test_engine_captures_graphs_unless_enforce_eager(engine_configs):
    from vllm.config import CUDAGraphMode

    assert engine_captures_graphs(engine_configs["default"])
    assert not engine_captures_graphs(engine_configs["eager"])
    cfg = engine_configs["default"]
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.NONE  # -cc.cudagraph_mode=NONE
    try:
        assert not engine_captures_graphs(cfg)
    finally:
        cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE


SPEC = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8)


def _plan(transport: str, ep_size: int = 2):
    return build_plan(SPEC, Knobs(transport=transport), 0, ep_size, device_type="cuda", quant="bf16",
                      backends=("triton", transport))


def test_uncapturable_layer_fails_the_start_naming_enforce_eager(engine_configs, monkeypatch):
    """vLLM's graph setting (``engine_graphs``) through the layer's start-up decision, as on a CUDA host."""
    from megamoe_backend.layer import startup
    from megamoe_backend.platform import facts as platform_facts

    cpu = torch.device("cpu")
    settle = lambda plan, cfg: startup.settle_plan(plan, object(), cpu, engine_graphs(cfg))  # noqa: E731
    settle(_plan("nccl"), engine_configs["default"])  # on CPU nothing is captured
    monkeypatch.setattr(platform_facts, "device_kind", lambda device: "cuda")
    with pytest.raises(GraphCaptureError, match=r"MEGA_DISPATCH=nccl \(ep_size 2\).*Add --enforce-eager"):
        settle(_plan("nccl"), engine_configs["default"])
    settle(_plan("nccl"), engine_configs["eager"])  # eager: the torch forward serves
    settle(_plan("ipc"), engine_configs["default"])  # the device P2P forward is captured
    settle(_plan("nccl", ep_size=1), engine_configs["default"])


def _moe(dp_size=2, sp_size=1):
    return SimpleNamespace(dp_size=dp_size, sp_size=sp_size, pcp_size=1, use_ep=True)


def _in_context(num_tokens_across_dp, fn):
    """Run ``fn`` inside a vLLM ForwardContext carrying DPMetadata for these per-DP-rank counts."""
    from vllm.config import VllmConfig
    from vllm.forward_context import DPMetadata, create_forward_context, override_forward_context

    dp = None if num_tokens_across_dp is None else DPMetadata(torch.tensor(num_tokens_across_dp, dtype=torch.int32))
    with override_forward_context(create_forward_context(None, VllmConfig(), dp_metadata=dp)):
        return fn(dp)


@pytest.mark.parametrize("counts, tp_split, sp_size, expected", [
    ([17, 1], 1, 1, 32),  # DP ranks with different batches: the maximum, to a power of two
    ([1, 17], 1, 1, 32),  # ... the same number on the rank that holds 1 token
    ([256, 256], 1, 1, 256),  # a padded graph batch (what every DP rank replays)
    ([17, 1], 2, 1, 16),  # TP=2 without SP: each TP rank sends ceil(17 / 2) = 9
    ([17, 1], 1, 2, 16),  # SP=2: vLLM's sp_local_sizes hands ceil(17 / 2) to each SP rank
    ([9000, 3], 1, 1, 8192),  # capped at MEGA_MAX_TOKENS_PER_RANK
])
def test_bound_from_vllms_dp_metadata(counts, tp_split, sp_size, expected):
    moe = _moe(sp_size=sp_size)
    outside = _in_context(counts, lambda dp: max_tokens_across_ranks(5, tp_split, moe, 8192))

    def inside_runner(dp):  # the runner's _sequence_parallel_context (local_sizes set), as in a real step
        with dp.sp_local_sizes(sp_size, pcp_size=1, use_ep=True):
            return max_tokens_across_ranks(5, tp_split, moe, 8192)

    assert outside == _in_context(counts, inside_runner) == expected


def test_bound_without_dp_metadata():
    # dp_size 1: the EP group is the TP group, every rank holds this batch
    assert _in_context(None, lambda dp: max_tokens_across_ranks(17, 2, _moe(dp_size=1), 8192)) == 16
    # dp_size > 1 but no counts in this forward: no rank knows the others' batches
    assert _in_context(None, lambda dp: max_tokens_across_ranks(17, 1, _moe(dp_size=2), 8192)) is None
    assert max_tokens_across_ranks(3, 1, _moe(dp_size=1), 8192) == 4  # no forward context at all
