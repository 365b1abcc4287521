"""The mori device forward (layer/forwards/mori.py) under the Triton interpreter, through the fake
mori fabric, two EP ranks as threads: the same answer as the eager forward over the same mori with
the same Triton experts, no host synchronisation of its own (sync_guard.py: what CUDA's sync-debug
mode would flag), mori's live row count read on the device, bad ids reported through the status
word after the step, a shape problem sent as an empty step.

Mutants run once (tests/rocm/mutants.py, 2026-12-04: each failed its test, named there):
``local-slots-first-weight`` (a repeated received id keeps its first occurrence's own weight, which
for a masked k = 0 is the sender's weight-0 copy: the bug an H200 run found) fails the first test
against the single-process layer; ``mori-total-recv-item`` (``int(total.item())`` after dispatch, as transport/mori.py's eager path
does, 331-347 before this issue) fails test_mori_device_forward_matches_the_eager_forward_without_a_host_sync
with HostSyncError; ``mori-raise-before-exchange`` (the status check before mori's collective)
fails test_bad_ids_are_reported_after_every_rank_finished_the_step (the peer's fabric barrier breaks:
BrokenBarrierError); ``routing-host-sync`` fails the first test too.
Not run on AMD hardware: mori's kernels, slot order and in-kernel sums are the fake's.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter test (CPU only); no ROCm GPU here either way", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
import triton.language.standard as _std  # noqa: E402

if type(_std._elementwise_max).__name__ != "InterpretedFunction":
    pytest.skip("Triton was imported before TRITON_INTERPRET=1 in this process; run tests/rocm on its own",
                allow_module_level=True)

from rocm_helpers import FakeDist, FakeGroup, run_ranks  # noqa: E402
from sync_guard import no_host_sync  # noqa: E402

from megamoe_backend.experts import quantize_expert_weights  # noqa: E402
from megamoe_backend.experts.triton import TritonExperts  # noqa: E402
from megamoe_backend.knobs import Knobs  # noqa: E402
from megamoe_backend.layer.megamoe_layer import MegaMoELayer  # noqa: E402
from megamoe_backend.layer.reference import rel_l2  # noqa: E402
from megamoe_backend.plan import build_plan  # noqa: E402
from megamoe_backend.spec import MoESpec  # noqa: E402
from megamoe_backend.transport import PeerInputError, clear_transport_cache  # noqa: E402
from megamoe_backend.transport.mori import MoriTransport  # noqa: E402

H, I, E, K, EP, MTPR = 64, 64, 4, 2, 2, 4
GROUP = FakeGroup((0, 1))  # the EP group mori's shmem runs on (one per process, as mori has it)
# The layers' cache keys (transport/cache.py) hold id(group): two ranks in one process need two objects
LAYER_GROUPS = [FakeGroup((0, 1)) for _ in range(EP)]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """Fresh caches, and one kernel at a time: Triton's interpreter patches triton.language while a
    kernel runs, so two rank threads must not interpret kernels at once (the lock is never held across
    mori's collectives, where the ranks wait for each other)."""
    from triton.runtime import interpreter

    lock = threading.RLock()
    run = interpreter.GridExecutor.__call__

    def one_at_a_time(self, *args, **kwargs):
        with lock:
            return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", one_at_a_time)
    clear_transport_cache()
    yield
    clear_transport_cache()


def _plan(rank, wire="bf16"):
    spec = MoESpec(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K, quant="a8w4")
    return build_plan(spec, Knobs(dispatch_wire=wire, max_tokens_per_rank=MTPR), ep_rank=rank, ep_size=EP,
                      backends=("triton", "mori"))


def _weights(rank):
    g = torch.Generator().manual_seed(11)
    w1, w2 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5, torch.randn(E, H, I, generator=g) * I ** -0.5
    lo, hi = rank * E // EP, (rank + 1) * E // EP
    return quantize_expert_weights(w1[lo:hi], w2[lo:hi], "mxfp4", gate_up_layout="interleaved")


def _layer(fakes, rank, wire, device_path):
    plan = _plan(rank, wire)
    transport = MoriTransport(plan, GROUP, torch.device("cpu"), gpus_per_node=8,
                              dist=FakeDist(rank=rank, log=fakes.mori.CALL_LOG), all_reduce_max=lambda s: s)
    return MegaMoELayer(plan, _weights(rank), group=LAYER_GROUPS[rank], transport=transport, device_path=device_path,
                        provider=TritonExperts(capacity=EP * MTPR * K))


def _inputs(seed=3):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(3, H, generator=g).to(torch.bfloat16) for _ in range(EP)]
    ids = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(3)]) for _ in range(EP)]
    ids[1][1, 1] = -1  # a masked entry
    ids[0][2, 0] = -1  # ... and one before the token's valid ones (sent as a weight-0 copy of a later id)
    return xs, ids, [torch.rand(3, K, generator=g) for _ in range(EP)]


def _on_ranks(fn):
    return run_ranks(fn, EP)


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
def test_mori_device_forward_matches_the_eager_forward_without_a_host_sync(fakes, wire):
    xs, ids, tw = _inputs()
    fakes.mori.ops.EpDispatchCombineOp.FABRIC_GENERATION = f"dev-{wire}"
    layers = _on_ranks(lambda r: _layer(fakes, r, wire, device_path=True))
    assert {layer.transport_name for layer in layers} == {"device mori"}

    def step(r):
        with no_host_sync():
            return layers[r](xs[r], ids[r], tw[r])

    got = _on_ranks(step)
    clear_transport_cache()
    fakes.mori.ops.EpDispatchCombineOp.FABRIC_GENERATION = f"eager-{wire}"
    eager = _on_ranks(lambda r: _layer(fakes, r, wire, device_path=False)(xs[r], ids[r], tw[r]))
    for g, e in zip(got, eager):
        # the device forward rounds each pair row to bf16 before the per-row sum (the CUDA device forwards
        # do the same); the eager one sums fp32 pair values: one bf16 rounding apart per pair
        assert rel_l2(g.float(), e.float()) < 5e-3
    assert all(torch.isfinite(g).all() for g in got)
    # and the single-process layer (no mori: all experts local), which shares no routing code with either
    g = torch.Generator().manual_seed(11)
    w1, w2 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5, torch.randn(E, H, I, generator=g) * I ** -0.5
    full = quantize_expert_weights(w1, w2, "mxfp4", gate_up_layout="interleaved")
    spec = _plan(0, wire).spec
    alone = MegaMoELayer(build_plan(spec, Knobs(dispatch_wire=wire, max_tokens_per_rank=EP * MTPR), 0, 1,
                                    backends=("torch", "gloo")), full)
    want = alone(torch.cat(xs), torch.cat(ids), torch.cat(tw))
    assert rel_l2(torch.cat(got).float(), want.float()) < 1e-2


def test_bad_ids_are_reported_after_every_rank_finished_the_step(fakes):
    xs, ids, tw = _inputs(seed=5)
    fakes.mori.ops.EpDispatchCombineOp.FABRIC_GENERATION = "bad-ids"
    layers = _on_ranks(lambda r: _layer(fakes, r, "bf16", device_path=True))
    bad = [i.clone() for i in ids]
    bad[0][2, 0] = 9

    def step(r, ids_=None):
        try:
            return layers[r](xs[r], (ids_ or bad)[r], tw[r])
        except ValueError as exc:
            return exc

    results = _on_ranks(step)
    assert isinstance(results[0], ValueError) and "topk_ids holds 9 at token 2" in str(results[0])
    assert isinstance(results[1], torch.Tensor)  # the peer finished its step: rank 0 took part before raising
    again = _on_ranks(lambda r: layers[r](xs[r], ids[r], tw[r]))  # reported once, then cleared
    assert all(torch.isfinite(a).all() for a in again)
    # on a GPU the host copy of the word lags: a problem of step N is seen at step N + 1. Plant one as if
    # an earlier step recorded it: the next step still runs on every rank before rank 0 raises it
    status = layers[0].path.workspace.status
    status.word.copy_(torch.tensor([2, 0, 77, 1]))
    status.publish()
    late = _on_ranks(lambda r: step(r, ids) if r == 0 else layers[r](xs[r], ids[r], tw[r]))
    assert isinstance(late[0], ValueError) and "topk_ids holds 77 at token 1" in str(late[0])
    assert isinstance(late[1], torch.Tensor)


def test_a_shape_or_bound_problem_sends_an_empty_step_then_raises(fakes):
    xs, ids, tw = _inputs(seed=6)
    fakes.mori.ops.EpDispatchCombineOp.FABRIC_GENERATION = "shape"
    layers = _on_ranks(lambda r: _layer(fakes, r, "bf16", device_path=True))
    too_many = torch.randn(MTPR + 1, H).to(torch.bfloat16), torch.zeros(MTPR + 1, K, dtype=torch.long), torch.ones(MTPR + 1, K)

    def step(r):
        args = too_many if r == 0 else (xs[r], ids[r], tw[r])
        try:
            return layers[r](*args)
        except PeerInputError as exc:
            return exc

    results = _on_ranks(step)
    assert isinstance(results[0], PeerInputError) and "exceed MEGA_MAX_TOKENS_PER_RANK=4" in str(results[0])
    assert "took part with no tokens" in str(results[0]) and isinstance(results[1], torch.Tensor)
    # the engine's token bound: it picks the tile config on the host; a bound below this rank's tokens
    # is refused the same way (an empty step first)
    assert all(layer.takes_token_bound for layer in layers)
    free = _on_ranks(lambda r: layers[r](xs[r], ids[r], tw[r]))
    bounded = _on_ranks(lambda r: layers[r](xs[r], ids[r], tw[r], max_tokens_across_ranks=4))
    assert all(torch.equal(a, b) for a, b in zip(free, bounded))

    def low(r):
        try:
            return layers[r](xs[r], ids[r], tw[r], max_tokens_across_ranks=2 if r == 0 else 4)
        except PeerInputError as exc:
            return exc

    results = _on_ranks(low)
    assert isinstance(results[0], PeerInputError) and "max_tokens_across_ranks=2 must lie in" in str(results[0])
    assert isinstance(results[1], torch.Tensor)
