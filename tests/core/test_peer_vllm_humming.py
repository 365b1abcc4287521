"""benchmarks/peer_vllm_humming.py on CPU: the peer is listed, skipped with its reason where vLLM 0.34 /
humming / a sm_90 GPU are missing, vLLM's block-size pick from humming's tuning buckets, valid_shape_m,
and the bench's MXFP4 weights in vLLM's [gate; up] checkpoint layout (bytes unchanged). The peer itself
runs on the GPU machine (python -m benchmarks.peer_vllm_humming)."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import peer_vllm_humming as pvh
from benchmarks import peer_api, peers
from benchmarks.bench_experts import make_weights
from megamoe_backend.experts.weights import deinterleave_gate_up


def test_the_peer_is_listed_and_made_by_name():
    assert "vllm_humming" in peers.PEER_NAMES


def test_no_vllm_skips_with_the_reason_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # not importable
    ready, skipped = peers.select(["vllm_humming"])
    assert ready == [] and skipped[0].peer == "vllm_humming"
    assert "import vLLM 0.34 failed" in skipped[0].reason and "setup_device.sh" in skipped[0].reason


def test_no_humming_skips_with_the_reason(monkeypatch):
    monkeypatch.setattr(pvh, "_import_stack", lambda: (_ for _ in ()).throw(
        pvh._unavailable("import humming (through vllm.utils.humming) failed (ModuleNotFoundError: humming)")))
    ready, skipped = peers.select(["vllm_humming"])
    assert not ready and "import humming" in skipped[0].reason


def test_no_gpu_or_not_hopper_skips(monkeypatch):
    monkeypatch.setattr(pvh, "_import_stack", lambda: {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ready, skipped = peers.select(["vllm_humming"])
    assert not ready and "no CUDA GPU" in skipped[0].reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    ready, skipped = peers.select(["vllm_humming"])
    assert not ready and "sm_100" in skipped[0].reason and "sm_90" in skipped[0].reason


def test_a_failing_import_in_select_never_raises(monkeypatch):
    def boom():
        raise pvh._unavailable("anything")
    monkeypatch.setattr(pvh, "_import_stack", boom)
    ready, skipped = peers.select(None)
    assert "vllm_humming" in [s.peer for s in skipped]


TUNING = [[0, 64, {"block_shape": [16, 128]}], [64, 1024, {"block_shape": [64, 256]}],
          [1024, 8192, {"block_shape": [128, 256]}]]


@pytest.mark.parametrize("m, want", [(1, 16), (64, 16), (65, 64), (1024, 64), (1025, 128), (8192, 128),
                                     (8193, 64), (0, 64)])
def test_block_size_follows_vllms_loop(m, want):
    """lo < M <= hi picks the bucket's BLOCK_M; no bucket: vLLM's default 64 (its loop has no open end)."""
    assert pvh.pick_block_size(TUNING, m) == want


def test_block_size_open_ended_bucket_is_read_as_vllm_reads_it():
    # humming may write hi <= 0 for "no upper end"; vLLM's loop compares literally, so M past lo falls to 64
    assert pvh.pick_block_size([[0, 16, {"block_shape": [16, 64]}], [16, -1, {"block_shape": [128, 256]}]], 4096) == 64


def test_valid_shape_m():
    assert pvh.valid_shape_m(1024, 6, 48, 48) == 6144
    assert pvh.valid_shape_m(7, 6, 48, 384) == 6  # ceil(42 / 8)


@pytest.mark.parametrize("layout", ["interleaved", "plain"])
def test_weights_in_vllm_checkpoint_layout_gate_then_up(layout):
    fp4, _ = make_weights(3, 256, 128, torch.device("cpu"), seed=3)
    w = fp4.as_rowmajor()
    if layout == "plain" and w.gate_up_layout == "interleaved":
        w = type(w)(**{**w.__dict__, "w1": deinterleave_gate_up(w.w1), "w1_scale": deinterleave_gate_up(w.w1_scale),
                       "gate_up_layout": "plain"})
    w13, s13, w2, s2 = pvh.to_vllm_mxfp4(w)
    ref = fp4.as_rowmajor()
    gate, up = (ref.w1[:, 0::2], ref.w1[:, 1::2]) if ref.gate_up_layout == "interleaved" else ref.w1.chunk(2, dim=1)
    assert torch.equal(w13, torch.cat((gate, up), dim=1)) and w13.is_contiguous()
    sg, su = ((ref.w1_scale[:, 0::2], ref.w1_scale[:, 1::2]) if ref.gate_up_layout == "interleaved"
              else ref.w1_scale.chunk(2, dim=1))
    assert torch.equal(s13, torch.cat((sg, su), dim=1))
    assert torch.equal(w2, ref.w2) and torch.equal(s2, ref.w2_scale)


def test_block_fp8_checkpoint_tensors_are_the_checkpoints_own():
    """The block-FP8 twin hands humming the checkpoint's tensors under the names its fp8 schema reads
    (``weight`` / ``weight_scale_inv``), [gate; up] rows as they are; interleaved rows or another fmt refused."""
    from benchmarks.bench_experts import make_block_fp8_weights

    _, bf16 = make_weights(2, 256, 128, torch.device("cpu"), seed=4)
    blk, _ = make_block_fp8_weights(bf16)
    t13, t2 = pvh.checkpoint_tensors(blk)
    assert set(t13) == set(t2) == {"weight", "weight_scale_inv"}
    assert torch.equal(t13["weight"].view(torch.uint8), blk.w1.view(torch.uint8))
    assert torch.equal(t13["weight_scale_inv"], blk.w1_scale) and t13["weight_scale_inv"].dtype == torch.float32
    assert t13["weight_scale_inv"].shape == (2, 2, 2) and t2["weight_scale_inv"].shape == (2, 2, 1)
    assert torch.equal(t2["weight"].view(torch.uint8), blk.w2.view(torch.uint8))
    assert pvh.SCHEMES["fp8_block"][1] == {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="gate; up"):
        pvh.checkpoint_tensors(type(blk)(**{**blk.__dict__, "gate_up_layout": "interleaved"}))
    with pytest.raises(ValueError, match="weights fmt 'bf16'"):
        pvh.checkpoint_tensors(bf16)


def test_the_block_fp8_twin_is_named_and_skipped_with_its_own_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    ready, skipped = peers.select(["vllm_humming_block_fp8"])
    assert not ready and skipped[0].peer == "vllm_humming_block_fp8"


def test_smoke_main_records_the_skip(tmp_path, monkeypatch):
    import json

    monkeypatch.setitem(sys.modules, "vllm", None)
    out = tmp_path / "s.json"
    assert pvh.main(["--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["peers"]["skipped"][0]["peer"] == "vllm_humming" and rec["results"] == []


def test_an_unexpected_failure_while_making_the_peer_is_a_skip(monkeypatch):
    def broken():
        raise KeyError("GemmType")
    monkeypatch.setattr(pvh, "_import_stack", broken)
    ready, skipped = peers.select(["vllm_humming"])
    assert not ready and "could not be made (KeyError" in skipped[0].reason


def test_the_call_runs_vllms_steps_in_order_with_fixed_buffers(monkeypatch):
    """The whole peer on CPU with every vLLM / humming function replaced by a recorder: load's schema and
    tuning calls, then per call quant -> align(w13 block) -> align(w2 block) -> w13 -> SwiGLU/quant -> w2 ->
    finalize, into the buffers bind allocated (the same tensors on every call)."""
    import contextlib
    import enum
    import types

    from megamoe_backend.experts.humming import library

    log = []
    mode = types.SimpleNamespace(should_quantize=True, has_group_scale=True, has_secondary_scale=False)

    class Schema:
        hadamard_block_size = 1

        @classmethod
        def from_config(cls, cfg):
            log.append(("from_config", cfg["quant_method"]))
            return cls()

        def convert_humming(self, tensors, shape_n_stacks, shape_k_stacks, param_dtype, num_experts):
            log.append(("convert", tuple(shape_n_stacks), tuple(shape_k_stacks), num_experts))
            return self, dict(tensors)

    def prepare(tensors, shape_n, shape_k, **kw):
        log.append(("prepare", shape_n, shape_k, kw["pad_n_to_multiple"], kw["pad_k_to_multiple"]))
        cfg = types.SimpleNamespace(shape_n=shape_n, pad_shape_n=0, input_quant_mode=mode, input_scale_group_size=128)
        return cfg, {"weight": tensors["weight"], "weight_scale": tensors["weight_scale"]}

    def heuristics(layer_config, use_f16_accum, use_batch_invariant, gemm_type):
        assert not use_f16_accum and not use_batch_invariant and gemm_type.value == "indexed"
        return [[0, 1 << 20, {"block_shape": [16 if layer_config.shape_n == 2 * 32 else 32, 128]}]]

    class Kernel:
        def __getitem__(self, grid):
            def launch(x, xq, xs, group, cols, stride, eps, **kw):
                log.append(("quant", grid, group, kw["use_ue8m0"]))
                assert xq.dtype == torch.float8_e4m3fn and xs.dtype == torch.float32
            return launch

    def align(topk_ids, block_size, num_experts, expert_map, ignore_invalid_experts):
        log.append(("align", block_size))
        return torch.zeros(8, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)

    bufs = []

    def forward(config, inputs, weight, outputs, top_k, valid_shape_m, **kw):
        log.append(("gemm", config.shape_n, top_k, valid_shape_m))
        bufs.append(outputs.data_ptr())
        outputs.fill_(1.0)
        return outputs

    def process(config, inputs, outputs, token_scales, activation_type, activation_impl, **kw):
        log.append(("process", activation_type, kw["layout"]))
        return outputs, torch.ones(inputs.shape[0], 1), None

    def mul_sum(inputs, topk_weights, topk_ids, expert_map, outputs):
        log.append(("mul_sum", tuple(inputs.shape)))
        outputs.copy_((inputs.float() * topk_weights.unsqueeze(-1)).sum(1))
        bufs.append(outputs.data_ptr())

    class GemmType(enum.Enum):
        INDEXED = "indexed"

    stack = {"BaseWeightSchema": Schema, "GemmType": GemmType, "prepare_and_transform_humming_tensors": prepare,
             "get_heuristics_config": heuristics, "humming_forward": forward, "may_process_input": process,
             "create_humming_locks": lambda d: torch.zeros(8, dtype=torch.int32),
             "vllm": types.SimpleNamespace(__version__="0.34.0"), "envs": types.SimpleNamespace(),
             "humming": types.SimpleNamespace(__version__="0.1.20"),
             "ApplyMoEActivationConfig": lambda clamp_limit: clamp_limit,
             "MoEActivation": types.SimpleNamespace(SILU="silu"), "moe_align_block_size": align,
             "moe_fused_mul_sum": mul_sum, "quant_kernel": Kernel(),
             "get_humming_activation": lambda a, c: {"activation_type": "binary_split", "activation_impl": f"{a}:{c}"},
             "check_and_fallback_input_schema": lambda weight_schema, input_schema, param_dtype, allow_fallback: input_schema,
             "quant_key_to_input_schema": lambda key: Schema(), "get_fp8_min_max": lambda: (-448.0, 448.0),
             "kFp8Dynamic128Sym": "k"}
    monkeypatch.setattr(pvh, "_import_stack", lambda: stack)
    monkeypatch.setattr(peer_api, "require_cuda", lambda name: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(library, "probe", lambda d: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    peer = pvh.make_peer()
    h, i, e, t, k = 256, 32, 3, 4, 2
    fp4, _ = make_weights(e, h, i, torch.device("cpu"), seed=1)
    peer.load(fp4, peers.PeerShape(h, i, k, 10.0), max_tokens=t)
    assert ("convert", (i, i), (h,), e) in log and ("convert", (h,), (i,), e) in log
    assert ("prepare", 2 * i, h, 256, 128) in log and ("prepare", h, i, 256, 128) in log
    assert peer.activation["activation_impl"] == "silu:10.0"
    x = torch.randn(t, h).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])
    w = torch.full((t, k), 0.5)
    call = peer.bind(x, ids, w)
    log.clear()
    y1 = call()
    steps = [s[0] for s in log]
    assert steps == ["quant", "align", "align", "gemm", "process", "gemm", "mul_sum"], steps
    assert log[0][1:] == ((t * h // 128,), 128, False)
    assert [s[1] for s in log if s[0] == "align"] == [16, 32]  # w13's then w2's BLOCK_M
    assert [s[1:] for s in log if s[0] == "gemm"] == [(2 * i, k, t * k), (h, 1, t * k)]
    assert log[-1] == ("mul_sum", (t, k, h))
    assert torch.equal(y1.float(), torch.ones(t, h))  # 2 routes x 0.5 x 1.0
    first = list(bufs)
    bufs.clear()
    assert call() is y1 and bufs == first  # fixed buffers
    assert peer.tactic(t) == "humming heuristics, BLOCK_M w13 16 / w2 32"
    with pytest.raises(RuntimeError, match="EP"):
        peer.load(fp4, peers.PeerShape(h, i, k, 10.0), max_tokens=t, ep_size=2)
