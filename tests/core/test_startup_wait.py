"""Which forwards wait with the start-up bound (megamoe_backend/layer/device/startup_wait.py).

The rule the P2P forward asks before each forward; the forward's use of the answer is checked by
tests/kernels/test_p2p_interpreter.py (a rank late by 4x MEGA_P2P_TIMEOUT_S in its first forward
ends nobody; the same lateness later is a timeout)."""

from __future__ import annotations

import pytest
import torch

from megamoe_backend.knobs import KnobError, Knobs
from megamoe_backend.layer.device.startup_wait import WaitFacts, takes_startup_bound


@pytest.mark.parametrize("facts,startup", [
    (WaitFacts(capturing=False, forwards_done=0, engine_captures=False, captured_before=False), True),  # first forward
    (WaitFacts(capturing=False, forwards_done=5, engine_captures=False, captured_before=False), False),  # eager engine, later
    (WaitFacts(capturing=False, forwards_done=5, engine_captures=True, captured_before=False), True),  # warm-up before capture
    (WaitFacts(capturing=True, forwards_done=0, engine_captures=True, captured_before=False), False),  # baked into a graph
    (WaitFacts(capturing=False, forwards_done=9, engine_captures=True, captured_before=True), False),  # serving after capture
    # a tile config no forward of the workspace ran (a first mid-sized batch after capture): its GEMMs compile
    (WaitFacts(capturing=False, forwards_done=9, engine_captures=True, captured_before=True, new_kernels=True), True),
    (WaitFacts(capturing=False, forwards_done=9, engine_captures=False, captured_before=False, new_kernels=True), True),
    (WaitFacts(capturing=True, forwards_done=9, engine_captures=True, captured_before=True, new_kernels=True), False),
])
def test_startup_bound_applies_to_start_up_forwards_only(facts, startup):
    assert takes_startup_bound(facts) is startup


def test_startup_timeout_knob():
    assert Knobs.from_env({}).p2p_startup_timeout_s == 600.0
    assert Knobs.from_env({"MEGA_P2P_STARTUP_TIMEOUT_S": "90"}).p2p_startup_timeout_s == 90.0
    for bad in ("0", "inf", "soon"):
        with pytest.raises(KnobError, match="MEGA_P2P_STARTUP_TIMEOUT_S"):
            Knobs.from_env({"MEGA_P2P_STARTUP_TIMEOUT_S": bad})


def _weights(experts: int = 48):
    from megamoe_backend.experts import ExpertWeights

    h, i = 256, 128
    z = lambda *shape: torch.zeros(shape, dtype=torch.uint8)  # noqa: E731 - shapes only: the key reads no value
    return ExpertWeights(w1=z(experts, 2 * i, h // 2), w2=z(experts, h, i // 2), w1_scale=z(experts, 2 * i, h // 32),
                         w2_scale=z(experts, h, i // 32), fmt="mxfp4")


def test_triton_kernel_key_follows_the_bound_s_tile_config(monkeypatch):
    """The key the P2P forward compares (TritonExperts.kernel_key, as a GPU host computes it: the GPU
    bucket tables): a bound in another bucket is a new key, another bound of the same bucket is not."""
    from megamoe_backend.experts.live import LiveRows
    from megamoe_backend.experts.triton import TritonExperts

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    provider, w, k, ep = TritonExperts(), _weights(), 6, 8
    counts = torch.zeros(ep, dtype=torch.int64)

    def key(bound):
        return provider.kernel_key(w, ep * bound * k, LiveRows(counts, bound, config_pairs=bound * k), torch.device("cpu"))

    decode, also_decode, mid, prefill = key(8), key(16), key(256), key(4096)  # rows per expert: 1, 2, 32, 512
    assert decode == also_decode
    assert len({decode, mid, prefill}) == 3
    unbounded = provider.kernel_key(w, ep * 4096 * k, LiveRows(counts, 4096), torch.device("cpu"))
    assert unbounded not in (decode, mid, prefill)  # every bucket's config at once, picked on the device
