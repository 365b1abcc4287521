"""benchmarks/peer_flashinfer_megamoe.py on CPU: the peer is listed and skipped with its reason where FlashInfer
0.7.4 / the CuTe DSL / FlashInfer's SM90 kernel drop / a sm_90 GPU are missing; the bench's MXFP4 weights in
FlashInfer's raw MegaMoE ABI read back independently (the nibble and E8M0 decode of FlashInfer's own test, its
gate8 / up8 pairing, its route-weighted top-k sum) against the bench's fp32 reference; and the calls the peer
makes on FlashInfer's public API, in order, with FlashInfer replaced by recorders. The peer itself runs on the
GPU machine (python -m benchmarks.peer_flashinfer_megamoe)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from benchmarks import peer_flashinfer_megamoe as pfm
from benchmarks import peer_api, peers
from benchmarks.bench_experts import make_weights
from benchmarks.peer_weights import to_flashinfer_megamoe
from benchmarks.references import token_reference
from megamoe_backend.experts import ExpertWeights
from megamoe_backend.experts.weights import deinterleave_gate_up
from megamoe_backend.layer.reference import rel_l2

PEER = "flashinfer_megamoe_sm90"
H, I, E = 256, 128, 3  # noqa: E741 - hidden, intermediate (multiples of FlashInfer's 128 fold), experts


# ----------------------------------------------------------------------------------------- skips
def test_the_peer_is_listed_and_made_by_name():
    assert PEER in peers.PEER_NAMES and peers.PEER_NAMES[-1] == PEER  # last: its kernel drop puts its src/ first on sys.path
    assert "flashinfer_megamoe_sm90" in __import__("benchmarks.engine_ratios").engine_ratios.ENGINE_PEERS


def test_no_flashinfer_skips_with_the_reason_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    ready, skipped = peers.select([PEER])
    assert not ready and skipped[0].peer == PEER
    assert "import flashinfer.moe_ep" in skipped[0].reason and "flashinfer074_setup.sh" in skipped[0].reason


def _fake_flashinfer(monkeypatch, drop: bool = True):
    fi = types.ModuleType("flashinfer")
    fi.__version__ = "0.7.4"
    moe_ep = types.ModuleType("flashinfer.moe_ep")
    for name in ("BootstrapConfig", "FleetParams", "MegaConfig", "MoEEpLayer", "MoEEpTensors", "PrequantizedMoEWeights",
                 "Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig"):
        setattr(moe_ep, name, type(name, (), {}))
    fi.moe_ep = moe_ep
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.moe_ep", moe_ep)
    if drop:
        d = types.ModuleType(pfm.DROP)
        d.resolve_hopper_mxfp4_knobs = d.hopper_mxfp4_default_tactic = lambda *a, **k: {}
        monkeypatch.setitem(sys.modules, pfm.DROP, d)
    else:
        monkeypatch.setitem(sys.modules, pfm.DROP, None)


def _fake_cutlass(monkeypatch):
    cutlass = types.ModuleType("cutlass")
    cutlass.__version__ = "4.8.1"
    cute = types.ModuleType("cutlass.cute")
    cutlass.cute = cute
    monkeypatch.setitem(sys.modules, "cutlass", cutlass)
    monkeypatch.setitem(sys.modules, "cutlass.cute", cute)


def test_no_cute_dsl_skips_naming_it(monkeypatch):
    _fake_flashinfer(monkeypatch)
    monkeypatch.setitem(sys.modules, "cutlass", None)
    _, skipped = peers.select([PEER])
    assert "import cutlass (nvidia-cutlass-dsl" in skipped[0].reason


def test_no_kernel_drop_skips_naming_it(monkeypatch):
    _fake_flashinfer(monkeypatch, drop=False)
    _fake_cutlass(monkeypatch)
    _, skipped = peers.select([PEER])
    assert "kernel drop" in skipped[0].reason and pfm.DROP in skipped[0].reason


def test_no_gpu_or_not_hopper_skips(monkeypatch):
    _fake_flashinfer(monkeypatch)
    _fake_cutlass(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, skipped = peers.select([PEER])
    assert "no CUDA GPU" in skipped[0].reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    _, skipped = peers.select([PEER])
    assert "sm_100" in skipped[0].reason and "sm_90" in skipped[0].reason


def test_an_unexpected_failure_while_making_the_peer_is_a_skip(monkeypatch):
    monkeypatch.setattr(pfm, "_import_stack", lambda: {}[0])
    _, skipped = peers.select([PEER])
    assert "could not be made (KeyError" in skipped[0].reason


def test_no_peer_on_a_cpu_host_lists_this_one_too(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "triton_kernels", None)
    monkeypatch.setitem(sys.modules, "vllm", None)
    ready, skipped = peers.select(None)
    assert not ready and PEER in [s.peer for s in skipped]


def test_smoke_main_records_each_step_and_the_skip(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    out = tmp_path / "s.json"
    assert pfm.main(["--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    steps = {s["step"]: s for s in rec["steps"]}
    assert list(steps)[:3] == ["environment", "imports", "make the peer"]
    imports = steps["imports"]["result"]
    assert imports["torch"]["ok"] and not imports["flashinfer"]["ok"]
    assert "Traceback" in imports["flashinfer"]["trace"]  # where it failed, not only that it did
    assert rec["peers"]["skipped"][0]["peer"] == PEER and rec["results"] == []


# ------------------------------------------------------------------------ the weights, read back
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def decode_raw(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 of FlashInfer's raw ABI as its own test reads it: element 2j in the LOW nibble of byte j, bit 3 the
    sign, magnitudes 0 .. 6; each 32 elements along K times 2^(E8M0 byte - 127)."""
    nib = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2).long()
    val = torch.where(nib & 8 != 0, -E2M1[nib & 7], E2M1[nib & 7])
    return val * torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)


def gate8_up8(w13: torch.Tensor) -> torch.Tensor:
    """FlashInfer's documented FC1 row order in the kernel: [gate; up] -> groups of 8 gate rows, 8 up rows."""
    e, rows, k = w13.shape
    gate, up = w13[:, : rows // 2], w13[:, rows // 2:]
    return torch.stack((gate.reshape(e, -1, 8, k), up.reshape(e, -1, 8, k)), dim=2).reshape(e, rows, k)


def megamoe_math(x, ids, w, raw, limit: float) -> torch.Tensor:
    """The kernel's math in fp32, as FlashInfer's oracle states it (FC1 rows gate8 / up8, gate clamped above,
    up clamped both ways, silu(gate) * up, times the route weight, FC2, summed over the top-k); no FP8."""
    fc1, fc2 = gate8_up8(decode_raw(raw.w13, raw.w13_scale)), decode_raw(raw.w2, raw.w2_scale)
    out = torch.zeros(x.shape[0], fc2.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            paired = (x[t].float() @ fc1[e].T).reshape(-1, 2, 8)
            gate, up = paired[:, 0].clamp(max=limit), paired[:, 1].clamp(-limit, limit)
            act = (torch.nn.functional.silu(gate) * up).reshape(-1) * w[t, j]
            out[t] += act @ fc2[e].T
    return out


@pytest.fixture(scope="module")
def weights():
    return make_weights(E, H, I, torch.device("cpu"), seed=5)


def _plain(w: ExpertWeights) -> ExpertWeights:
    return ExpertWeights(deinterleave_gate_up(w.w1), w.w2, "mxfp4", "plain", deinterleave_gate_up(w.w1_scale), w.w2_scale)


@pytest.mark.parametrize("layout", ["interleaved", "plain"])
def test_raw_abi_holds_the_bench_values_gate_rows_first(weights, layout):
    fp4, bf16 = weights
    raw = to_flashinfer_megamoe(fp4 if layout == "interleaved" else _plain(fp4))
    assert raw.w13.shape == (E, 2 * I, H // 2) and raw.w13_scale.shape == (E, 2 * I, H // 32)
    assert raw.w2.shape == (E, H, I // 2) and raw.w2_scale.shape == (E, H, I // 32)
    assert all(t.dtype == torch.uint8 and t.is_contiguous() for t in (raw.w13, raw.w13_scale, raw.w2, raw.w2_scale))
    fc1 = decode_raw(raw.w13, raw.w13_scale)
    assert torch.equal(fc1[:, :I], bf16.w1[:, 0::2].float())  # the bench's gate rows (interleaved g0, u0, ...)
    assert torch.equal(fc1[:, I:], bf16.w1[:, 1::2].float())
    assert torch.equal(decode_raw(raw.w2, raw.w2_scale), bf16.w2.float())
    assert torch.equal(raw.w13.sort(dim=1).values, fp4.w1.sort(dim=1).values)  # bytes moved, none re-rounded


def test_the_kernels_math_on_these_bytes_is_the_bench_reference(weights):
    """FlashInfer's oracle math (fp32) on the converted bytes against the bench's fp32 token reference:
    gate / up order, nibble order, scales, route weights and the top-k sum all agree."""
    fp4, bf16 = weights
    g = torch.Generator().manual_seed(0)
    t, k = 5, 2
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    got = megamoe_math(x, ids, w, to_flashinfer_megamoe(fp4), 10.0)
    ref = token_reference(x, ids, w, bf16, 10.0, torch.arange(t))
    assert rel_l2(got, ref) < 1e-5


def test_other_formats_are_refused(weights):
    _, bf16 = weights
    with pytest.raises(ValueError, match="fmt='bf16'"):
        to_flashinfer_megamoe(bf16)


# ------------------------------------------------------------------ the calls, FlashInfer replaced
class Recorder:
    """A stand-in for FlashInfer's classes: keeps its keyword arguments, logs its construction."""

    log: list = []

    def __init__(self, **kw):
        self.__dict__.update(kw)
        Recorder.log.append((type(self).__name__, kw))


def _stack(log: list) -> dict:
    class Workspace:
        def __init__(self, tokens):
            self.tokens, self.destroyed = tokens, False

        def destroy(self):
            self.destroyed = True
            log.append(("destroy workspace", self.tokens))

    class Layer(Recorder):
        def create_workspace(self, tokens):
            log.append(("create_workspace", tokens))
            return Workspace(tokens)

        def forward(self, t, *, workspace):
            log.append(("forward", workspace.tokens, t.topk_ids.dtype, t.topk_weights.dtype))
            t.output.fill_(2.0)
            return t.output

        def warmup(self, t, *, workspace):
            log.append(("warmup", workspace.tokens))
            self.forward(t, workspace=workspace)

        def destroy(self):
            log.append(("destroy layer",))

    names = ("BootstrapConfig", "FleetParams", "MegaConfig", "MoEEpTensors", "PrequantizedMoEWeights")
    stack = {n: type(n, (Recorder,), {}) for n in names}
    stack["Config"] = type("Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig", (Recorder,), {})
    stack["MoEEpLayer"] = lambda **kw: Layer(**kw)
    default = {"mma_tiler_mnk": (256, 16, 256)}
    stack.update(flashinfer=types.SimpleNamespace(__version__="0.7.4"), cutlass=types.SimpleNamespace(__version__="4.8.1"),
                 resolve_knobs=lambda knobs, **kw: (log.append(("resolve", knobs, kw["num_max_tokens"])), default)[1],
                 default_tactic=lambda tokens: default)
    return stack


def fake_hopper(monkeypatch, log: list) -> None:
    """FlashInfer's API replaced by recorders (``_stack``) on a CPU that answers as an sm_90 GPU."""
    monkeypatch.setattr(pfm, "_import_stack", lambda: _stack(log))
    monkeypatch.setattr(peer_api, "require_cuda", lambda name: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_the_peer_calls_flashinfers_api_in_order(weights, monkeypatch):
    log: list = []
    Recorder.log = log
    fake_hopper(monkeypatch, log)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.delenv("MEGA_NO_DIST", raising=False)
    fp4, _ = weights
    peer = pfm.make_peer()
    peer.load(fp4, peers.PeerShape(H, I, 2, 10.0), max_tokens=16)
    import os

    assert os.environ["MEGA_NO_DIST"] == "1"  # FlashInfer's single-rank mode: no NVSHMEM, no process group
    made = dict((n, kw) for n, kw in log if isinstance(kw, dict))
    assert made["Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig"] == {"intermediate_size": I, "top_k": 2,
                                                                       "gate_up_clamp": 10.0}
    assert made["BootstrapConfig"] == {"world_size": 1, "rank": 0, "device": 0}
    assert made["FleetParams"] == {"num_experts": E, "max_tokens_per_rank": 16, "token_hidden_size": H}
    assert made["MegaConfig"]["quantize_input"] is True and made["MegaConfig"]["preprocess_weights"] is True
    pack = made["PrequantizedMoEWeights"]
    assert torch.equal(pack["w13"], to_flashinfer_megamoe(fp4).w13)  # [gate; up] rows, the bytes of the bench
    assert "gate_up_clamp=10.0" in peer.config and "MEGA_NO_DIST=1" in peer.config
    log.clear()
    x = torch.randn(4, H).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]], dtype=torch.int32)
    call = peer.bind(x, ids, torch.full((4, 2), 0.5, dtype=torch.float64))
    y = peer.warm(call)
    assert call() is y and torch.equal(y.float(), torch.full((4, H), 2.0))
    assert [e[0] for e in log] == ["create_workspace", "resolve", "MoEEpTensors", "warmup", "forward", "forward"]
    assert log[4][1:] == (4, torch.int64, torch.float32)  # FlashInfer's dtypes, whatever the bench passes
    assert peer.tactic(4).startswith("default table: ")
    log.clear()
    peer.bind(x[:2], ids[:2], torch.ones(2, 2))  # another token count: a workspace of its own, the old one gone
    assert log[:2] == [("destroy workspace", 4), ("create_workspace", 2)]
    peer.load(fp4, peers.PeerShape(H, I, 2, 10.0), max_tokens=16)  # same weights and shape: nothing rebuilt
    assert ("destroy layer",) not in log
    log.clear()
    peer.release()
    assert log == [("destroy workspace", 2), ("destroy layer",)] and peer.layer is None
    with pytest.raises(RuntimeError, match="EP ranks not covered"):
        peer.load(fp4, peers.PeerShape(H, I, 2, 10.0), max_tokens=16, ep_size=2)


def test_no_limit_turns_flashinfers_default_clamp_off(weights, monkeypatch):
    """FlashInfer's config defaults gate_up_clamp to 10.0: a model without a limit must pass None."""
    log: list = []
    Recorder.log = log
    fake_hopper(monkeypatch, log)
    pfm.make_peer().load(weights[0], peers.PeerShape(H, I, 2, None), max_tokens=8)
    made = dict((n, kw) for n, kw in log if isinstance(kw, dict))
    assert made["Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig"]["gate_up_clamp"] is None
