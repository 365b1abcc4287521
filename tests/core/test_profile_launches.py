"""benchmarks/research/profile_experts.py's per-launch split: a GEMM's tile passes (full / short / ride) are
launches of one kernel name, so the A/B numbers in docs/triton.md that name a single pass depend on
telling them apart by their order inside a forward; and its ``--trim`` routing (the timing proxy for
narrower tiles in docs/triton.md) cuts exactly the pairs it says. Pure Python; no GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "research" / "profile_experts.py"


def _module():
    spec = importlib.util.spec_from_file_location("profile_experts", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _per_launch():
    return _module().per_launch


def test_launches_are_keyed_by_order_and_take_the_median():
    per_launch = _per_launch()
    forward = ["layout", "gemm1", "gemm1", "rowscale", "gemm2", "gemm2"]
    times = [[1, 600, 500, 10, 300, 250], [2, 640, 560, 12, 330, 290], [3, 610, 520, 11, 310, 260]]
    kernels = [(name, t) for row in times for name, t in zip(forward, row)]
    out = per_launch(kernels, 3)
    assert list(out) == ["layout#0", "gemm1#0", "gemm1#1", "rowscale#0", "gemm2#0", "gemm2#1"]
    assert out["gemm1#0"] == 610 and out["gemm1#1"] == 520 and out["gemm2#1"] == 260  # medians, per position


def test_forwards_that_do_not_line_up_give_nothing():
    per_launch = _per_launch()
    assert per_launch([("a", 1.0), ("b", 2.0), ("a", 1.0)], 2) == {}  # not a whole number of forwards
    assert per_launch([("a", 1.0), ("b", 2.0), ("b", 2.0), ("a", 1.0)], 2) == {}  # different launch order
    assert per_launch([], 3) == {}


def test_trim_keeps_the_first_pairs_of_the_experts_in_range():
    import torch

    from megamoe_backend.experts import ExpertPairs

    trim_pairs = _module().trim_pairs
    g = torch.Generator().manual_seed(0)
    slot = torch.tensor([0] * 40 + [1] * 20 + [2] * 50 + [3] * 33)[torch.randperm(143, generator=g)]
    pairs = ExpertPairs(torch.arange(143), slot, torch.rand(143, generator=g))
    out = trim_pairs(pairs, 5, 33, 48, 32)
    assert torch.bincount(out.slot, minlength=5).tolist() == [32, 20, 50, 32, 0]  # 40 and 33 cut to 32; 20, 50 kept
    for e in range(4):  # the kept pairs of an expert are its first ones, in pair order, with their rows and weights
        mine = (pairs.slot == e).nonzero().flatten()
        kept = out.row[out.slot == e]
        assert torch.equal(kept, pairs.row[mine[: len(kept)]])
        assert torch.equal(out.weight[out.slot == e], pairs.weight[mine[: len(kept)]])
    assert torch.equal(trim_pairs(pairs, 5, 60, 64, 32).row, pairs.row)  # no expert in range: unchanged


@pytest.mark.parametrize("bad", ["33:48", "a:b:c", "33:48:40", "48:33:32"])
def test_bad_trim_is_refused_naming_the_option(bad):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(_PATH), "--trim", bad], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--trim" in proc.stderr and "LO:HI:KEEP" in proc.stderr, proc.stderr[-500:]
