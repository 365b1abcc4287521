"""benchmarks/peers.py and its plumbing on CPU: which peers run and why the others are skipped, the project's
MXFP4 weights in each peer's layout (read back with an independent ml_dtypes decoder, bit for bit), the
routing metadata matmul_ogs is handed, and the JSON / table / PNG of a run with a peer injected at the
Peer boundary (CPU timing). The peers themselves run on the H200 (benchmarks/run_peers_h200.sh)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from benchmarks import bench_experts, bench_layer, bench_layer_emulated, peers
from benchmarks.bench_experts import Case, make_weights
from benchmarks.peer_weights import to_flashinfer, to_triton_kernels
from benchmarks.references import check_tokens, token_reference
from megamoe_backend.experts import ExpertWeights
from megamoe_backend.experts.weights import deinterleave_gate_up
from megamoe_backend.layer.reference import rel_l2

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
H, I, E = 256, 128, 3  # noqa: E741 - hidden, intermediate (multiples of the Hopper swizzles' 64 / 256), experts


def peers_dir() -> Path | None:
    """../shared/peers (the device copy's source) or .peers, where this checkout has one."""
    for d in (os.environ.get("MEGAMOE_PEERS_DIR"), REPO.parent / "shared" / "peers", REPO / ".peers"):
        if d and (Path(d) / "triton_kernels" / "triton_kernels" / "matmul_ogs.py").is_file():
            return Path(d)
    return None


@pytest.fixture(scope="module")
def weights() -> tuple[ExpertWeights, ExpertWeights]:
    return make_weights(E, H, I, CPU, seed=3)


# ----------------------------------------------------------------------- an independent MXFP4 reader
def decode_mxfp4(codes: torch.Tensor, scales: torch.Tensor, k_axis: int) -> np.ndarray:
    """fp32 values of packed e2m1 bytes (even element in the low nibble, along ``k_axis``) with one E8M0
    byte per 32 along the same axis, decoded by ml_dtypes (no project code)."""
    c = np.moveaxis(codes.contiguous().numpy(), k_axis, -1)
    s = np.moveaxis(scales.contiguous().numpy(), k_axis, -1)
    nib = np.stack([c & 0xF, c >> 4], axis=-1).reshape(*c.shape[:-1], c.shape[-1] * 2).astype(np.uint8)
    vals = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = np.repeat(s.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, axis=-1)
    return np.moveaxis(vals * scale, -1, k_axis)


def test_flashinfer_layout_holds_the_same_values_up_rows_first(weights):
    fp4, bf16 = weights
    fi = to_flashinfer(fp4)
    assert fi.w1.shape == (E, 2 * I, H // 2) and fi.w1_scale.shape == (E, 2 * I, H // 32) and fi.w1.is_contiguous()
    w1 = decode_mxfp4(fi.w1, fi.w1_scale, k_axis=2)
    gate_up = deinterleave_gate_up(bf16.w1.float()).numpy()  # the project's [gate; up]
    np.testing.assert_array_equal(w1[:, :I], gate_up[:, I:])  # FlashInfer's canonical [up; gate]
    np.testing.assert_array_equal(w1[:, I:], gate_up[:, :I])
    np.testing.assert_array_equal(decode_mxfp4(fi.w2, fi.w2_scale, k_axis=2), bf16.w2.float().numpy())
    # every byte is one of the project's: only GEMM1's rows moved
    assert torch.equal(fi.w1.sort(dim=1).values, fp4.w1.sort(dim=1).values)


def test_plain_gate_up_weights_land_in_the_same_peer_layouts(weights):
    fp4, _ = weights
    plain = ExpertWeights(deinterleave_gate_up(fp4.w1), fp4.w2, "mxfp4", "plain", deinterleave_gate_up(fp4.w1_scale),
                          fp4.w2_scale)
    for a, b in ((to_flashinfer(plain), to_flashinfer(fp4)), (to_triton_kernels(plain), to_triton_kernels(fp4))):
        for name in ("w1", "w1_scale", "w2", "w2_scale"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_triton_kernels_layout_holds_the_same_values_k_major(weights):
    fp4, bf16 = weights
    tk = to_triton_kernels(fp4)
    assert tk.w1.shape == (E, H // 2, 2 * I) and tk.w1.stride(1) == 1  # K-major view, as matmul_ogs asserts
    w1 = decode_mxfp4(tk.w1, tk.w1_scale, k_axis=1)  # [E, H, 2I], columns gate/up interleaved
    np.testing.assert_array_equal(w1, bf16.w1.float().transpose(1, 2).numpy())
    np.testing.assert_array_equal(decode_mxfp4(tk.w2, tk.w2_scale, k_axis=1), bf16.w2.float().transpose(1, 2).numpy())


def test_triton_kernels_hopper_swizzles_keep_every_byte(weights, monkeypatch):
    """The peer's own Hopper value / scale swizzles (convert_layout, torch code) over the converted weights,
    undone by the peer's unswizzle and read back by the ml_dtypes decoder: the project's values exactly."""
    d = peers_dir()
    if d is None:
        pytest.skip("no ../shared/peers (or .peers) with triton_kernels in this checkout")
    monkeypatch.syspath_prepend(str(d / "triton_kernels"))
    tkt = pytest.importorskip("triton_kernels.tensor")
    from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout

    fp4, bf16 = weights
    tk = to_triton_kernels(fp4)
    for codes, scales, ref in ((tk.w1, tk.w1_scale, bf16.w1), (tk.w2, tk.w2_scale, bf16.w2)):
        v = tkt.convert_layout(tkt.wrap_torch_tensor(codes, dtype=tkt.FP4), HopperMXValueLayout, mx_axis=1)
        s = tkt.convert_layout(tkt.wrap_torch_tensor(scales), HopperMXScaleLayout, mx_axis=1, num_warps=8)
        assert v.shape == [E, codes.shape[1] * 2, codes.shape[2]] and v.storage.data.stride(-2) == 1
        assert not torch.equal(v.storage.data.reshape(-1), codes.contiguous().reshape(-1))  # really swizzled
        back_v = v.storage.layout.unswizzle_data(v.storage.data)
        back_s = s.storage.layout.unswizzle_data(s.storage.data)
        np.testing.assert_array_equal(decode_mxfp4(back_v, back_s, k_axis=1), ref.float().transpose(1, 2).numpy())


# ----------------------------------------------------------------------------- routing metadata
def emulate_matmul_ogs(x, w1, w2, r: peers.SortedRouting, k: int, limit):
    """matmul_ogs' documented index semantics over fp32 weights: GatherIndx Y = X[src // k], ScatterIndx
    Y[dst] = X, the top-k reduce over slots whose src index is not -1 (triton_kernels.matmul_ogs)."""
    from megamoe_backend.experts import swiglu

    n_pairs = r.combine.numel()
    offs = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), r.hist.long()]), 0)
    slots = torch.zeros(n_pairs, w2.shape[1])
    for e in range(r.hist.numel()):
        s = torch.arange(int(offs[e]), int(offs[e + 1]))
        rows = x[r.combine[s].long() // k].float()
        out = swiglu(rows @ w1[e].T, "interleaved", limit) @ w2[e].T * r.gate_scal[s, None]
        slots[r.combine[s].long()] = out
    keep = (r.dispatch != -1).view(-1, k, 1)
    return (slots.view(-1, k, w2.shape[1]) * keep).sum(1)


def test_sorted_routing_feeds_matmul_ogs_the_rank_pairs(weights):
    fp4, bf16 = weights
    g = torch.Generator().manual_seed(5)
    t, k = 9, 2
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 2 * E, (t, k), generator=g)  # experts 0..E-1 here, E..2E-1 on another rank
    ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 1] + 1) % (2 * E), ids[:, 1])
    w = torch.rand(t, k, generator=g)
    local = torch.where(ids < E, ids, -1)
    r = peers.sorted_routing(local, w, E)
    assert r.hist.tolist() == [int((local == e).sum()) for e in range(E)]
    assert int((r.dispatch != -1).sum()) == int((local >= 0).sum()) == int(r.hist.sum())
    assert (r.combine[int(r.hist.sum()):] == -1).all()
    got = emulate_matmul_ogs(x, bf16.w1.float(), bf16.w2.float(), r, k, 10.0)
    ref = token_reference(x, local, w, bf16, 10.0, torch.arange(t))
    assert rel_l2(got, ref) < 1e-6


# ---------------------------------------------------------------------------------------- detection
def test_no_peer_on_a_cpu_host_each_skipped_with_its_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    monkeypatch.setitem(sys.modules, "triton_kernels", None)
    ready, skipped = peers.select(None)
    assert ready == [] and [s.peer for s in skipped] == list(peers.PEER_NAMES)
    reasons = {s.peer: s.reason for s in skipped}
    assert "import flashinfer failed" in reasons["flashinfer_humming"] and "setup_device.sh" in reasons["flashinfer_w4a16"]
    assert "import triton_kernels failed" in reasons["triton_kernels"] and "PYTHONPATH" in reasons["triton_kernels"]
    assert peers.describe(ready, skipped)["skipped"][0] == {"peer": "flashinfer_humming", "reason": reasons["flashinfer_humming"]}


def test_an_importable_peer_without_a_gpu_says_so(monkeypatch):
    fused_moe = types.SimpleNamespace(CutlassHummingConfig=type("CutlassHummingConfig", (), {"supported": classmethod(lambda c, a: a == 90)}),
                                      CutlassW4A16Config=type("CutlassW4A16Config", (), {"supported": classmethod(lambda c, a: a == 90)}))
    fake = types.ModuleType("flashinfer")
    fake.__version__, fake.fused_moe = "0.7.2.post1", fused_moe
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fused_moe)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ready, skipped = peers.select(["flashinfer_humming"])
    assert not ready and "no CUDA GPU" in skipped[0].reason


def test_a_gpu_other_than_sm90_is_refused_by_the_peers_own_predicate(monkeypatch):
    cfg = type("CutlassHummingConfig", (), {"supported": classmethod(lambda c, a: a == 90)})
    fused_moe = types.SimpleNamespace(CutlassHummingConfig=cfg, CutlassW4A16Config=cfg)
    fake = types.ModuleType("flashinfer")
    fake.__version__, fake.fused_moe = "0.7.2.post1", fused_moe
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fused_moe)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    _, skipped = peers.select(["flashinfer_humming"])
    assert "sm_100" in skipped[0].reason and "SM90" in skipped[0].reason


# ------------------------------------------------------------------- plumbing with an injected peer
class ScaledReference(peers.Peer):
    """A peer at the Peer boundary for CPU: its "MoE" is the fp32 reference times (1 + eps), so its relL2
    must read eps; it handles EP shares as the real peers do (ids of other ranks left out)."""

    name, version, config, scope = "fake_peer", "0", "reference x (1 + eps)", "test"

    def __init__(self, eps: float = 0.01):
        super().__init__()
        self.eps, self.loads = eps, 0

    def load(self, weights, shape, *, max_tokens, ep_size=1, ep_rank=0):
        self.loads += 1
        self.w, self.shape, self.experts, self.ep_size, self.ep_rank = weights, shape, weights.num_experts, ep_size, ep_rank

    def bind(self, x, ids, w):
        lo = self.ep_rank * self.experts
        local = torch.where((ids >= lo) & (ids < lo + self.experts), ids - lo, -1)
        out = token_reference(x, local, w, self.w, self.shape.swiglu_limit, torch.arange(x.shape[0])) * (1 + self.eps)
        return lambda: out.to(torch.bfloat16)

    def stages_us(self, x):
        return {"routing": "fixed", "gemm1": 3.0, "gemm2": 1.0}


def test_peer_results_reach_the_experts_json_table_and_png(weights, tmp_path, capsys):
    fp4, bf16 = weights
    tokens, topk = 16, 2
    x, pairs = bench_experts.make_routing(tokens, E, topk, H, CPU, seed=1)
    check = bench_experts.TokenCheck(x, pairs, bf16, 10.0, check_tokens(tokens, peers.CHECK_TOKENS, 0, CPU))
    peer = ScaledReference(eps=0.01)
    shape = peers.PeerShape(H, I, topk, 10.0)
    results = peers.run_peers([peer], fp4, shape, x, pairs.slot.view(tokens, topk), pairs.weight.view(tokens, topk),
                              check.of_tokens, max_tokens=tokens)
    r = results[0]
    assert r.error == "" and r.pairs == tokens * topk and r.us > 0 and not r.graph
    assert abs(r.relL2 - 0.01) < 2e-3  # bf16 output rounding on top of the injected 1 %
    project = Case(E, tokens, len(pairs), "a8w4", "triton", us=2 * r.us, active_experts=E)
    ceilings = {"measured_copy_tbs": 4.0, "measured_fp8_gemm_tflops": 1300.0, "measured_bf16_gemm_tflops": 680.0}
    bench_experts.peer_ratios(r, [project], ceilings, E, H, I)
    assert r.ratios["a8w4_over_peer"] == pytest.approx(2.0)
    assert r.ratios["a8w4_over_peer_gemms"] == pytest.approx(2 * r.us / 4.0)  # over GEMM1 + GEMM2 alone
    stream_us = E * bench_experts.weight_bytes_per_expert(H, I, "mxfp4") / 4.0e6
    assert r.ratios["x_copy_measured"] == pytest.approx(r.us / stream_us)
    bench_experts.print_peer_table(results)
    assert "fake_peer" in capsys.readouterr().out
    out = tmp_path / "experts.json"
    bench_experts.save(str(out), {"peers": peers.describe([peer], [])}, [project], [], results)
    saved = json.loads(out.read_text())
    assert {"us", "relL2", "version", "config", "tactic"} <= set(saved["peers"][0])
    png = tmp_path / "experts.png"
    assert bench_experts.main(["--replot", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_peer_that_fails_is_recorded_not_raised(weights):
    fp4, _ = weights

    class Broken(ScaledReference):
        def load(self, *a, **k):
            raise RuntimeError("bad layout")

    x = torch.zeros(4, H, dtype=torch.bfloat16)
    ids, w = torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)
    (r,) = peers.run_peers([Broken()], fp4, peers.PeerShape(H, I, 2, None), x, ids, w, lambda y: 0.0, max_tokens=4)
    assert r.error.startswith("load: RuntimeError: bad layout") and r.us != r.us


class FakeFlashInferTuner:
    """FlashInfer's autotune surface as the flat EP call meets it: ``autotune`` contexts stack their
    ``tuning_buckets`` and count the tuning ones (flashinfer/autotuner/autotuner.py: a nested
    ``autotune(False)`` keeps tuning on while an ``autotune(True)`` is open); ``choose_one`` tunes the
    current bucket when tuning, and otherwise returns its winner, or -1 (the default tactic) for a bucket
    it never tuned, as the real tuner does."""

    WINNERS = {"trtllm::fused_moe::gemm1": 7, "trtllm::fused_moe::gemm2": 11}

    def __init__(self):
        self.stack, self.tuning, self.calls, self.winners = [], 0, [], {}

    def autotune(self, tune_mode=True, cache=None, tuning_buckets=None):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.stack.append(tuple(tuning_buckets) if tuning_buckets is not None else (self.stack or [None])[-1])
            self.tuning += bool(tune_mode)
            try:
                yield
            finally:
                self.stack.pop()
                self.tuning -= bool(tune_mode)
        return ctx()

    def choose_one(self, custom_op, runners, tuning_config, inputs, **kwargs):
        key = (custom_op, self.stack[-1] if self.stack else None)
        if self.tuning and key[1]:
            self.winners[key] = self.WINNERS[custom_op]
        return None, self.winners.get(key, -1)

    def cutlass_fused_moe(self, x, ids, w, fc1, fc2, dtype, scales, *, output, **kw):
        self.calls.append(("tune" if self.tuning else "lookup", self.stack[-1] if self.stack else None))
        for op in self.WINNERS:
            self.choose_one(op, [], None, [x])
        output.fill_(1.0)


def test_flat_ep_call_is_tuned_and_looked_up_at_the_ranks_exact_token_count(monkeypatch):
    """The emulated EP rank's FlashInfer peer (flat cutlass_fused_moe): every call enters
    ``autotune(tuning_buckets=(rows,))``, so ``warm`` profiles that one bucket (not every bucket up to
    65536 tokens: minutes a case) and the timed / captured calls look the same bucket up; the JSON's
    tactic names the tactics the tuner handed out, and a call FlashInfer gave its default tactic (-1)
    is flagged untuned. Mutation run once: a call without the bucket context records ('tune', None)."""
    tuner = FakeFlashInferTuner()
    fake = types.ModuleType("flashinfer")
    fake.autotune = tuner.autotune
    fm = types.SimpleNamespace(cutlass_fused_moe=tuner.cutlass_fused_moe, cutlass_fused_moe_workspace_size=lambda *a, **k: 16)
    autotuner_mod = types.ModuleType("flashinfer.autotuner")
    autotuner_mod.AutoTuner = types.SimpleNamespace(get=lambda: tuner)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(sys.modules, "flashinfer.autotuner", autotuner_mod)
    peer = object.__new__(peers.FlashInferCutlass)
    peers.Peer.__init__(peer)
    rows, local_experts = 37, 4
    peer.fi, peer.fm, peer.kind, peer.tune_cache, peer.layer = fake, fm, "humming", None, None
    peer.flat_tactics = {}
    peer.device, peer.experts, peer.ep_size, peer.ep_rank, peer.ceiling = CPU, local_experts, 2, 1, 8192
    peer.shape = peers.PeerShape(H, I, 2, 10.0)
    peer.activation = types.SimpleNamespace(alpha=1.0, beta=0.0, limit=10.0)
    peer.view = {k: torch.zeros(local_experts, 2) for k in ("fc1_expert_weights", "fc2_expert_weights", "fc1_expert_scales",
                                                            "fc2_expert_scales", "fc1_residual_scale", "fc2_residual_scale")}
    peer.view["fc2_act_global"] = torch.ones(())
    x = torch.zeros(rows, H, dtype=torch.bfloat16)
    ids, w = torch.zeros(rows, 2, dtype=torch.int64), torch.ones(rows, 2)
    call = peer.bind(x, ids, w)
    assert peer.warm(call).eq(1.0).all()
    call()
    assert tuner.calls == [("tune", (rows,)), ("lookup", (rows,))]
    assert peer.tactic(rows).endswith("(gemm1, gemm2) = (7, 11)") and f"exactly {rows} tokens" in peer.tactic(rows)
    assert peer.untuned(rows) == "" and "choose_one" not in vars(tuner)  # the tuner's own method again
    untuned_call = peer.bind(torch.zeros(rows + 1, H, dtype=torch.bfloat16), ids[:1].repeat(rows + 1, 1), w[:1].repeat(rows + 1, 1))
    untuned_call()  # never warmed: FlashInfer's default tactic (-1), as after an OOM while profiling
    assert peer.tactic(rows + 1).endswith("(-1, -1)") and "default tactic" in peer.untuned(rows + 1)


def test_a_load_out_of_gpu_memory_releases_the_peers_and_tries_again(weights):
    """On an H100 the peers' copies of 192 experts did not fit beside each other (2026-12-06: triton_kernels
    OutOfMemoryError at load). A load that runs out of memory releases every peer's weights and retries
    once. Mutation run once: without the retry the second peer's result is the load error."""
    fp4, _ = weights
    holders = []

    class Roomy(ScaledReference):
        def load(self, *a, **k):
            if any(p.loaded_key is not None for p in holders if p is not self):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake: another peer holds its weights)")
            super().load(*a, **k)
            self.loaded_key = "held"

    first, second = Roomy(), Roomy()
    second.name = "second_peer"
    holders += [first, second]
    x = torch.randn(4, H).to(torch.bfloat16)
    ids, w = torch.tensor([[0, 1]] * 4), torch.full((4, 2), 0.5)
    results = peers.run_peers([first, second], fp4, peers.PeerShape(H, I, 2, None), x, ids, w, lambda y: 0.0, max_tokens=4)
    assert [r.error for r in results] == ["", ""] and all(r.usable() for r in results)
    assert first.loaded_key is None and second.loaded_key == "held" and second.loads == 1


def test_an_untuned_peer_figure_is_recorded_but_stands_for_nothing(weights):
    """FlashInfer falls back to its default tactic when profiling fails (H100, EP 8 x 8192: OOM while
    profiling 36306 tokens, 33.8 ms against 6.4 ms tuned at ep_size 1): the result keeps its µs and the
    reason, and the benches leave it out of ratios, tables' peer columns and plots (PeerResult.usable)."""
    fp4, _ = weights

    class Untuned(ScaledReference):
        def untuned(self, tokens):
            return f"no winner at {tokens} tokens"

    x = torch.randn(4, H).to(torch.bfloat16)
    ids, w = torch.tensor([[0, 1]] * 4), torch.full((4, 2), 0.5)
    (r,) = peers.run_peers([Untuned()], fp4, peers.PeerShape(H, I, 2, None), x, ids, w, lambda y: 0.0, max_tokens=4)
    assert r.untuned == "no winner at 4 tokens" and r.us == r.us and not r.usable()
    case = bench_experts.Case(E, 4, 8, "a8w4", "triton", us=10.0)
    bench_experts.peer_ratios(r, [case], {}, E, H, I)
    assert r.ratios == {}


def test_layer_cases_draw_their_peers(tmp_path):
    cases = [bench_layer.LayerCase(48, t, "a8w4", "fp8", "bf16", layer_us=10.0 * t, experts_us=9.0 * t, naive_torch_us=30.0 * t,
                                   floor_us=5.0 * t, peers_us={"flashinfer_humming": 11.0 * t}) for t in (8, 128)]
    png = tmp_path / "layer.png"
    bench_layer.plot(cases, str(png), "NVIDIA H100 80GB HBM3")
    bench_layer.print_table(cases)
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("emulated", [False, True], ids=["layer", "emulated"])
def test_a_replot_names_the_card_the_json_was_made_on(tmp_path, monkeypatch, emulated):
    """The PNG's title names the GPU in the JSON's meta (an H100 run once drew "on one H200" over its figures)."""
    import matplotlib.figure

    if emulated:
        case = bench_layer_emulated.EmulatedCase(8, 48, 8, "a8w4", "fp8", "bf16", "uniform", True, rank_us=5.0,
                                                 experts_us=4.0)
    else:
        case = bench_layer.LayerCase(48, 8, "a8w4", "fp8", "bf16", layer_us=10.0, experts_us=9.0, naive_torch_us=30.0,
                                     floor_us=5.0)
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"meta": {"gpu": {"name": "NVIDIA H100 80GB HBM3"}}, "cases": [dataclasses.asdict(case)]}))
    titles = []
    real = matplotlib.figure.Figure.suptitle
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle", lambda fig, t, **kw: titles.append(t) or real(fig, t, **kw))
    args = types.SimpleNamespace(replot=str(saved), plot=str(tmp_path / "run.png"))
    assert bench_layer.run(args) == 0
    assert len(titles) == 1 and "one NVIDIA H100 80GB HBM3" in titles[0] and "H200" not in titles[0], titles
    assert bench_experts.card_name({}) == "no GPU"


def test_emulated_rank_share_runs_the_peer_on_that_ranks_pairs(tmp_path):
    ep, experts, topk, hidden, inter = 4, 2, 2, 64, 64
    weights = [make_weights(experts, hidden, inter, CPU, seed=10 + r)[0] for r in range(ep)]
    routes = bench_layer_emulated.make_routes("uniform", [6] * ep, ep * experts, topk, hidden, CPU, seed=2)
    spec = types.SimpleNamespace(hidden_size=hidden, moe_intermediate_size=inter, num_experts_per_tok=topk, swiglu_limit=10.0)
    args = types.SimpleNamespace(seed=0)
    rank = 2
    (r,) = bench_layer_emulated.run_rank_peers([ScaledReference(0.02)], routes, rank, ep, experts, weights, spec, args,
                                               {"measured_copy_tbs": 4.0})
    ids = torch.cat([x[1] for x in routes])
    assert r.ep_size == ep and r.ep_rank == rank and r.experts == experts
    assert r.tokens == int(((ids // experts) == rank).any(1).sum()) and r.pairs == int(((ids // experts) == rank).sum())
    assert abs(r.relL2 - 0.02) < 3e-3 and "x_copy_measured" in r.ratios
    c = bench_layer_emulated.EmulatedCase(ep, experts, 6, "a8w4", "fp8", "bf16", "uniform", True, rank_us=5.0, experts_us=4.0,
                                          peers_us={"fake_peer": r.us}, peer_rank=rank)
    png = tmp_path / "emulated.png"
    bench_layer_emulated.plot_emulated([c], str(png), "NVIDIA H200")
    assert png.stat().st_size > 10_000


def test_bench_experts_on_cpu_lists_the_skipped_peers(tmp_path):
    """The whole bench under the Triton interpreter with --peers: no peer runs on CPU, each is listed with
    its reason, the project's figure carries the per-token relL2 the peers are held to."""
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_experts", "--experts", "3", "--tokens", "2",
                           "--hidden", "64", "--intermediate", "64", "--topk", "2", "--schemes", "a8w4", "--no-baseline",
                           "--peers", "--json", str(out), "--plot", str(png)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = json.loads(out.read_text())
    assert [s["peer"] for s in saved["meta"]["peers"]["skipped"]] == list(peers.PEER_NAMES)
    assert saved["peers"] == [] and saved["meta"]["complete"] is True
    res = saved["results"][0]
    assert res["error"] == "" and 0 < res["rel_l2_tokens"] < 0.1
    assert png.stat().st_size > 10_000


def test_block_fp8_layer_bench_runs_emulated_only(capsys):
    """`bench layer --schemes fp8_block` at ep_size 1 is refused with the command that times block-FP8 there; the
    emulated bench takes it (its wire is the fp8_g128 rows, its weights block-FP8)."""
    assert bench_layer.main(["--schemes", "fp8_block", "a8w4"]) == 2
    assert "bench experts --schemes fp8_block" in capsys.readouterr().err
    from benchmarks.layer_common import EMULATED_SCHEMES, WEIGHT_FMT_OF

    assert EMULATED_SCHEMES["fp8_block"] == "fp8" and WEIGHT_FMT_OF["fp8_block"] == "fp8_block"
    assert set(WEIGHT_FMT_OF) == set(EMULATED_SCHEMES)
