"""Run one of the offline sm_90a scripts (benchmarks/research/sass_report.py, benchmarks/research/wgmma_probe.py) for a test.

Why a subprocess: the kernels must be compiled, not interpreted, and this test directory's conftest
puts Triton into interpreter mode on CPU machines before anything imports it. Shared so that the
skip below (the one condition under which these checks cannot run) is written once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_sm90a_script(script: str, args: list[str], cache_dir: Path, timeout: int) -> str:
    """stdout of ``python benchmarks/research/<script> <args>`` with TRITON_INTERPRET unset and its own Triton
    cache; skips the test where Triton's wheel ships no NVIDIA ptxas, fails it on any other error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "research" / script), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip("the sm_90a check needs the ptxas bundled in Triton's NVIDIA backend; this Triton wheel ships none "
                    "(e.g. a ROCm build)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
