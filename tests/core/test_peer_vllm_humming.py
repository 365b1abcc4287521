"""benchmarks/peer_vllm_humming.py on CPU: the peer is listed, skipped with its reason where vLLM 0.34 /
humming / a sm_90 GPU are missing, vLLM's block-size pick from humming's tuning buckets, valid_shape_m,
and the bench's MXFP4 weights in vLLM's [gate; up] checkpoint layout (bytes unchanged). The peer itself
runs on the GPU machine (python -m benchmarks.peer_vllm_humming)."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import peer_vllm_humming as pvh
from benchmarks import peers
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


def test_smoke_main_records_the_skip(tmp_path, monkeypatch):
    import json

    monkeypatch.setitem(sys.modules, "vllm", None)
    out = tmp_path / "s.json"
    assert pvh.main(["--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["peers"]["skipped"][0]["peer"] == "vllm_humming" and rec["results"] == []
