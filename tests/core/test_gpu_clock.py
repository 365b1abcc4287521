"""bench.gpu_clock: what the bench records about the SM clock while a case is timed."""

from __future__ import annotations

import itertools
import time

import torch

from benchmarks import gpu_clock


def test_no_nvml_on_cpu_records_nothing():
    with gpu_clock.ClockSampler(torch.device("cpu")) as s:
        time.sleep(0.01)
    assert s.stats() == {} and s.samples == []


def test_stats_from_samples(monkeypatch):
    """Median / min MHz, max W and the power- / heat-slowed fractions come from the polled samples;
    a reader that fails ends the sampling, never the timed block."""
    seq = itertools.chain([(1980, 300.0, 0x0, 5000, 10.0), (1665, 690.5, 0x4, 5350, 10.5), (1545, 700.2, 0x4 | 0x8, 5700, 11.0),
                           (1980, 420.0, 0x1, 5800, 12.0)],
                          itertools.repeat(None))

    def read():
        v = next(seq)
        if v is None:
            raise RuntimeError("NVML went away")
        return v

    closed = []
    monkeypatch.setattr(gpu_clock, "_nvml_reader", lambda device: (read, lambda: closed.append(True)))
    with gpu_clock.ClockSampler(torch.device("cuda"), period_s=0.001) as s:
        deadline = time.time() + 5
        while len(s.samples) < 4 and time.time() < deadline:
            time.sleep(0.005)
    st = s.stats()
    assert closed == [True]
    assert st == {"sm_mhz_median": (1665 + 1980) / 2, "sm_mhz_min": 1545, "power_w_max": 700.2,
                  "energy_mean_w": 0.4,  # (5800 - 5000) mJ over 2 s
                  "power_capped_frac": 0.5, "thermal_frac": 0.25, "samples": 4}
    s.samples = [(1980, 300.0, 0x0, None, 1.0), (1980, 300.0, 0x0, None, 2.0)]  # no energy counter
    assert s.stats()["energy_mean_w"] is None
