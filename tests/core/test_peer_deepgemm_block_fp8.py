"""benchmarks/peer_deepgemm_block_fp8.py on CPU: the peer is listed and skipped with its reason (and the build that
fixes it) where DeepGEMM or an sm_90 GPU is missing; and its glue (the host-side contiguous layout, the row gather,
SwiGLU with the clamp, the route-weighted sum, an EP rank's partial sum) against the bench's fp32 reference, with
DeepGEMM's GEMM replaced by a torch twin of what its SM90 1D2D contract states: row m of D is A[m] (e4m3 x its
1 x 128 fp32 scales) times expert m_indices[m]'s B (e4m3 x its 128 x 128 fp32 block scales), rows marked -1 not
read back. DeepGEMM itself runs on the GPU machine (deepgemm_setup.sh builds it there)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from benchmarks import peer_deepgemm_block_fp8 as pdg
from benchmarks import peers
from benchmarks.bench_data import make_block_fp8_weights
from benchmarks.peer_api import PeerShape
from benchmarks.references import token_reference
from megamoe_backend.experts import ExpertWeights
from megamoe_backend.layer.reference import rel_l2

H, I, E, K = 256, 128, 4, 2  # noqa: E741 - hidden, intermediate, experts, top-k
ALIGN = 128


def _cast(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128):
    """DeepGEMM's per_token_cast_to_fp8 contract: 1 x gran_k groups, scale amax / 448, e4m3 values."""
    assert not use_ue8m0 and gran_k == 128
    g = x.float().view(x.shape[0], -1, gran_k)
    sf = g.abs().amax(-1).clamp(1e-4) / 448.0
    return (g / sf.unsqueeze(-1)).to(torch.float8_e4m3fn).view(x.shape), sf


def _fake_deep_gemm(calls: list):
    dg = types.ModuleType("deep_gemm")
    dg.__version__ = "test-twin"
    dg.get_mk_alignment_for_contiguous_layout = lambda: ALIGN

    def gemm(a, b, d, m_indices, disable_ue8m0_cast=False):
        (aq, asf), (bq, bsf) = a, b
        calls.append((tuple(aq.shape), tuple(m_indices.shape)))
        assert disable_ue8m0_cast and m_indices.dtype == torch.int32 and aq.shape[0] == m_indices.shape[0] == d.shape[0]
        assert aq.shape[0] % ALIGN == 0, "DeepGEMM's contiguous layout: M a multiple of the alignment"
        a32 = aq.float() * asf.repeat_interleave(128, dim=1)
        for m in range(aq.shape[0]):
            g = int(m_indices[m])
            if g < 0:
                d[m] = float("nan")  # a pad row: nothing may read it back
                continue
            b32 = bq[g].float() * bsf[g].repeat_interleave(128, 0).repeat_interleave(128, 1)
            d[m] = (b32 @ a32[m]).to(d.dtype)

    dg.m_grouped_fp8_gemm_nt_contiguous = gemm
    return dg


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    bf16 = ExpertWeights((torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16),
                         (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16), "bf16", "interleaved")
    blk, deq = make_block_fp8_weights(bf16)
    x = torch.randn(6, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(6)])
    w = torch.rand(6, K, generator=g)
    return blk, deq, x, ids, w / w.sum(1, keepdim=True)


def _peer(calls: list) -> pdg.DeepGemmBlockFp8:
    return pdg.DeepGemmBlockFp8(_fake_deep_gemm(calls), _cast, torch.device("cpu"))


def test_the_peer_is_listed_and_skipped_without_deepgemm_naming_the_build(monkeypatch):
    assert pdg.NAME in peers.BLOCK_FP8_PEER_NAMES
    monkeypatch.setattr(pdg, "require_cuda", lambda name: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    ready, skipped = peers.select([pdg.NAME])
    assert not ready and "import deep_gemm failed" in skipped[0].reason and "deepgemm_setup.sh" in skipped[0].reason


def test_not_hopper_is_skipped_naming_the_arch(monkeypatch):
    monkeypatch.setattr(pdg, "require_cuda", lambda name: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    _, skipped = peers.select([pdg.NAME])
    assert "sm_100" in skipped[0].reason


@pytest.mark.parametrize("limit", [None, 0.5])
def test_the_whole_call_is_the_fp32_moe_on_its_block_fp8_weights(limit):
    blk, deq, x, ids, w = _problem()
    calls: list = []
    peer = _peer(calls)
    peer.load(blk, PeerShape(H, I, K, limit), max_tokens=6)
    y = peer.bind(x, ids, w)()
    ref = token_reference(x, ids, w, deq, limit, torch.arange(6))
    assert rel_l2(y.float(), ref) < 0.06
    rows = calls[0][0][0]
    counts = torch.bincount(ids.view(-1), minlength=E)
    assert rows == int(((counts + ALIGN - 1) // ALIGN * ALIGN).sum())  # each expert's rows padded, nothing more
    assert "rows" in peer.tactic(6)


def test_an_ep_rank_returns_the_partial_sum_of_its_own_experts():
    blk, deq, x, ids, w = _problem(1)
    half = E // 2
    rank1 = ExpertWeights(blk.w1[half:], blk.w2[half:], "fp8_block", "plain", blk.w1_scale[half:], blk.w2_scale[half:])
    peer = _peer([])
    peer.load(rank1, PeerShape(H, I, K, None), max_tokens=6, ep_size=2, ep_rank=1)
    y = peer.bind(x, ids, w)()
    local = torch.where(ids >= half, ids - half, torch.full_like(ids, -1))
    deq1 = types.SimpleNamespace(w1=deq.w1[half:], w2=deq.w2[half:], fmt="bf16", gate_up_layout="plain", hidden=H,
                                 num_experts=half)
    ref = token_reference(x, local, w, deq1, None, torch.arange(6))
    assert rel_l2(y.float(), ref) < 0.06


def test_a_rank_no_pair_reaches_returns_zeros_not_its_pad_rows():
    blk, _, x, _, w = _problem(3)
    peer = _peer([])
    half = E // 2
    rank1 = ExpertWeights(blk.w1[half:], blk.w2[half:], "fp8_block", "plain", blk.w1_scale[half:], blk.w2_scale[half:])
    peer.load(rank1, PeerShape(H, I, K, None), max_tokens=6, ep_size=2, ep_rank=1)
    ids = torch.tensor([[0, 1]] * 6)  # every pair on rank 0: rank 1 runs one pad block (its rows NaN in the twin)
    y = peer.bind(x, ids, w)()
    assert torch.equal(y, torch.zeros_like(y))


def test_a_pair_summed_into_the_wrong_token_fails():
    """Planted mutation: the layout's source token of each row shifted by one; the call must miss the reference."""
    blk, deq, x, ids, w = _problem(2)
    peer = _peer([])
    peer.load(blk, PeerShape(H, I, K, None), max_tokens=6)
    layout = peer._layout

    def shifted(ids_):
        rows, m_indices, row_of_pair, src = layout(ids_)
        return rows, m_indices, row_of_pair, (src + 1) % x.shape[0]

    peer._layout = shifted
    y = peer.bind(x, ids, w)()
    assert rel_l2(y.float(), token_reference(x, ids, w, deq, None, torch.arange(6))) > 0.5


def test_an_emulated_ep_rank_runs_the_peer_on_its_share_of_block_fp8_experts():
    """bench layer --emulate --schemes fp8_block --peers deepgemm_block_fp8: the peer on one rank's share (the tokens
    with a pair there, global ids), held to the fp32 reference of that rank's block-FP8 experts (references.LocalExperts
    dequantises them per 128 x 128 block)."""
    from benchmarks import bench_layer_emulated as emulated

    ep, experts = 2, E // 2
    blk, _, _, _, _ = _problem(4)
    rank_weights = [ExpertWeights(blk.w1[r * experts:(r + 1) * experts], blk.w2[r * experts:(r + 1) * experts],
                                  "fp8_block", "plain", blk.w1_scale[r * experts:(r + 1) * experts],
                                  blk.w2_scale[r * experts:(r + 1) * experts]) for r in range(ep)]
    routes = emulated.make_routes("uniform", [6] * ep, ep * experts, K, H, torch.device("cpu"), seed=3)
    spec = types.SimpleNamespace(hidden_size=H, moe_intermediate_size=I, num_experts_per_tok=K, swiglu_limit=10.0)
    (r,) = emulated.run_rank_peers([_peer([])], routes, 1, ep, experts, rank_weights, spec,
                                   types.SimpleNamespace(seed=0), {})
    assert r.peer == pdg.NAME and r.ep_rank == 1 and not r.error, r.error
    assert r.relL2 < 0.06


def test_the_emulated_bench_runs_each_weight_formats_peers_once_per_routes(monkeypatch):
    """link_peers reuses a peer run across the cases of one routing only on weights of one format: an A8W4 case's
    MXFP4 peers never stand for a block-FP8 case of the same tokens."""
    from benchmarks import bench_layer_emulated as emulated

    runs = []
    monkeypatch.setattr(emulated, "run_rank_peers", lambda ready, *a, **k: runs.append(ready) or [])
    monkeypatch.setattr(peers, "release_all", lambda ready: None)
    cases = []
    for scheme in ("a8w4", "a8w4", "fp8_block"):
        c = emulated.EmulatedCase(8, 48, 128, scheme, "fp8", "bf16", "uniform", True, rank_us_by_rank=[1.0] * 8,
                                  experts_us_by_rank=[1.0] * 8)
        emulated.link_peers(c, cases, [object()], None, 3, 8, 48, None, None, None, {}, [])
        cases.append(c)
    assert len(runs) == 2 and [c.peer_rank for c in cases] == [3, 3, 3]
