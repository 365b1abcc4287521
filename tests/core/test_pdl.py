"""Programmatic dependent launch (experts/triton/pdl.py): which devices the experts forward launches
with it, decided in one place from the device's facts (injected here: no GPU on CI). That the
kernels then wait for their predecessor before touching memory is checked on their sm_90a PTX
(tests/kernels/test_sm90a_small_kernels.py, test_sass.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the experts' Triton package (CI installs triton)")
from megamoe_backend.experts.triton import pdl  # noqa: E402


@pytest.fixture
def gpu_facts(monkeypatch):
    """Make pdl_launch see a CUDA device of the given capability (and ROCm or not), compiled mode."""

    def set_facts(capability=(9, 0), hip=None, interpret="0"):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setenv("TRITON_INTERPRET", interpret)

    return set_facts


@pytest.mark.parametrize("capability, expected", [((9, 0), True), ((10, 0), True), ((8, 9), False), ((8, 0), False)])
def test_hopper_and_later_launch_with_pdl(gpu_facts, capability, expected):
    gpu_facts(capability=capability)
    assert pdl.pdl_launch(torch.device("cuda", 0)) is expected
    assert pdl.pdl_launch("cuda") is expected


def test_no_pdl_under_the_interpreter_rocm_or_cpu(gpu_facts):
    gpu_facts(interpret="1")
    assert pdl.pdl_launch("cuda") is False  # the interpreter cannot run griddepcontrol
    gpu_facts(hip="6.4")
    assert pdl.pdl_launch("cuda") is False  # ROCm builds of torch report cuda devices
    gpu_facts()
    assert pdl.pdl_launch("cpu") is False


def test_launch_keywords_follow_the_decision():
    assert pdl.pdl_args(True) == {"PDL": True, "launch_pdl": True}
    assert pdl.pdl_args(False) == {"PDL": False}  # Triton's AMD backend refuses an unknown launch_pdl option


def test_the_row_rescales_run_a_fuller_grid_than_the_other_row_kernels(gpu_facts, monkeypatch):
    """frag8's row re-scales over live rows run RESCALE_PROGRAMS_PER_SM programs per SM (24: at 8 the EP 8 rank's
    re-scales at 8192 tokens took 613 us against 443 us, H100, benchmarks/results/h100_pdl_rescale_ab.json); the
    other row kernels' persistent grids (quantisation over live rows, mori's pair sum) keep 8 per SM. Facts of a
    132-SM GPU are injected; plan_launches is what the provider calls."""
    from types import SimpleNamespace

    from megamoe_backend.experts.live import LiveRows
    from megamoe_backend.experts.triton import launch_plan

    gpu_facts()
    monkeypatch.setattr(launch_plan, "_SMS", {})  # the documented per-device cache, refilled from the injected facts
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda", 0)
    live = LiveRows(torch.zeros(8, dtype=torch.int64), 8192, config_pairs=8192 * 6)
    plan = launch_plan.plan_launches(None, 8 * 8192 * 6, 48, "frag8", live, cuda)
    assert launch_plan.RESCALE_PROGRAMS_PER_SM == 24
    assert plan.rescale_programs == 24 * 132
    assert launch_plan.persistent_grid(cuda) == 8 * 132
    assert launch_plan.plan_launches(None, 8192 * 6, 48, "frag8", None, cuda).rescale_programs is None  # one program per row
