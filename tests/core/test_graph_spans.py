"""benchmarks/research/emulated_kernel_spans.py's ``graph_spans``: a kernel launched n > 1 times per rank
step is split by launch order (frag8's A and A2 re-scales are one kernel name), so the issue 48 figures
that name one re-scale depend on telling them apart by their order inside a step. Pure Python; no GPU."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "research" / "emulated_kernel_spans.py"


class _Event:
    def __init__(self, name: str, start: float, end: float):
        self.name = name
        self.time_range = types.SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)


def _spans(monkeypatch, step, ranks=3, replays=2):
    """graph_spans over ``ranks`` x ``replays`` steps of (name, µs) launches, 1 µs apart; ``step`` may
    also be the whole profile (a list of such lists is taken as the launches of all steps together)."""
    events, t = [], 0.0
    launches = step[0] if isinstance(step[0], list) else step * (ranks * replays)
    for name, us in launches:
        events.append(_Event(name, t, t + us))
        t += us + 1.0
    monkeypatch.setitem(sys.modules, "graph_replay_spans",
                        types.SimpleNamespace(profiled_kernels=lambda g, n: events))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    spec = importlib.util.spec_from_file_location("emulated_kernel_spans_under_test", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.graph_spans(types.SimpleNamespace(replay=lambda: None), ranks, replays)


def test_a_kernel_launched_twice_per_step_is_split_by_order(monkeypatch):
    step = [("layout", 1.0), ("rowscale", 5.0), ("gemm1", 10.0), ("rowscale", 3.0), ("gemm2", 7.0)]
    kernels = _spans(monkeypatch, step)["kernels"]
    assert set(kernels) == {"layout", "rowscale [1/2]", "gemm1", "rowscale [2/2]", "gemm2"}
    assert kernels["rowscale [1/2]"]["busy_us"] == 5.0 and kernels["rowscale [2/2]"]["busy_us"] == 3.0
    assert kernels["rowscale [1/2]"]["launches"] == 1.0 and kernels["gemm1"]["gap_before_us"] == 1.0


def test_counts_that_do_not_divide_into_steps_keep_one_name(monkeypatch):
    profile = [("a", 2.0), ("b", 1.0), ("a", 2.0), ("a", 2.0), ("b", 1.0)]  # 2 steps, "a" 3 times
    spans = _spans(monkeypatch, [profile], ranks=2, replays=1)
    assert set(spans["kernels"]) == {"a", "b"} and spans["kernels"]["a"]["launches"] == 1.5
