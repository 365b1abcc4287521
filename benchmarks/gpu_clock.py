"""SM clock, power and clock-limit reasons sampled (NVML) while a benchmark case is timed.

Why: on the H200 here a sustained experts forward reaches the 700 W limit within ~0.1 s and the
driver lowers the SM clock from 1980 to ~1650 MHz ("SW power cap"), also at 1024 tokens per rank,
while a short burst (a few forwards after an idle gap, what ``benchmarks/research/profile_experts.py`` times)
runs at 1980 MHz: the same kernels then measure 7-14 % apart (docs/triton.md). The bench times
back-to-back replays, as a serving GPU runs; each case records what the clock did meanwhile so
that figures taken in different modes, or on a cooler or hotter GPU, can be told apart.

NVML comes through ``pynvml`` (nvidia-ml-py, when installed: the H200 image here has it); without
it, or on ROCm / CPU, the sampler records nothing and the bench runs as before.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

# nvmlClocksEventReasons bits that mean "slowed for power" (SW power cap, HW power brake) and for
# heat (SW / HW thermal slowdown); HW slowdown (0x8), which the driver sets for either, is counted
# with heat so that POWER_BITS means the power limit alone.
POWER_BITS = 0x4 | 0x80
THERMAL_BITS = 0x20 | 0x40 | 0x8


class ClockSampler:
    """``with ClockSampler(device) as s: ...`` then ``s.stats()``: one background thread polls NVML
    every ``period_s`` while the block runs (the timed work itself is on the GPU: the main thread
    mostly waits in synchronize, so the polling does not compete with it for the GIL)."""

    def __init__(self, device: torch.device, period_s: float = 0.02):
        self.device = device
        self.period_s = period_s
        self.samples: list[tuple] = []  # (SM MHz, W, reason bits, energy counter mJ or None, perf_counter s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read = None
        self._close = None

    def __enter__(self) -> "ClockSampler":
        self._read, self._close = _nvml_reader(self.device)
        if self._read is not None:
            self._thread = threading.Thread(target=self._poll, name="megamoe-clock-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._close is not None:
            self._close()  # NVML counts inits: each sampler releases its own

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._read())
            except Exception:  # noqa: BLE001 - a failed read ends sampling, never the benchmark
                return
            self._stop.wait(self.period_s)

    def stats(self) -> dict:
        """Median / min SM MHz, max W (NVML's power reading, an average that lags), the fraction of
        samples slowed for power / for heat, and the mean W from the GPU's energy counter between the
        first and last sample (None where the counter is missing). The counter is coarse: over a
        bench case's ~0.3 s it reads 630-700 W on a capped H200 and up to ~890 W for a case that
        starts after an idle gap (the cap acts on a running average), so it shows the regime, not a
        per-forward energy to rank tiles by. {} if NVML was not available or nothing was sampled."""
        if not self.samples:
            return {}
        mhz = [s[0] for s in self.samples]
        n = len(self.samples)
        first, last = self.samples[0], self.samples[-1]
        mean_w = None
        if first[3] is not None and last[3] is not None and last[4] > first[4]:
            mean_w = round((last[3] - first[3]) / 1000.0 / (last[4] - first[4]), 1)
        return {
            "sm_mhz_median": statistics.median(mhz),
            "sm_mhz_min": min(mhz),
            "power_w_max": round(max(s[1] for s in self.samples), 1),
            "energy_mean_w": mean_w,
            "power_capped_frac": round(sum(bool(s[2] & POWER_BITS) for s in self.samples) / n, 3),
            "thermal_frac": round(sum(bool(s[2] & THERMAL_BITS) for s in self.samples) / n, 3),
            "samples": n,
        }


def _nvml_reader(device: torch.device):
    """(read, close): read() returns (SM MHz, W, reason bits, energy mJ or None, time s) for
    ``device``; close() releases NVML. (None, None) without NVML."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None, None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons

        def energy_mj():
            try:
                return pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            except Exception:  # noqa: BLE001 - counter not supported on this GPU / driver
                return None

        def read() -> tuple:
            return (pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                    pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0, int(reasons(handle)), energy_mj(), time.perf_counter())

        read()
        return read, pynvml.nvmlShutdown
    except Exception:  # noqa: BLE001 - no pynvml / no NVML driver: sample nothing
        return None, None
