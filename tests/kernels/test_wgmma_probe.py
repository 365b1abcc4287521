"""benchmarks/research/wgmma_probe.py times what its docstring says: compiled for sm_90a (Triton's ptxas, no GPU),
its loop is the frag8 K step's MMA alone — BN/64 x BK/32 = 8 FP8 wgmmas per step of shape
64 x N x 32 with the weights as the register A operand — and, with the retire, exactly one full wait
per step (without it, none: Triton keeps groups in flight). The H200 numbers it gave are in
benchmarks/results/h200_wgmma_probe.json and benchmarks/research/NOTEBOOK.md ("The 64-row tiles' MMA alone")."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton", reason="the probe is a Triton kernel")
from sm90a_script import run_sm90a_script  # noqa: E402


def test_probe_loop_is_the_frag8_step_mma(tmp_path):
    stdout = run_sm90a_script("wgmma_probe.py", ["--sass"], tmp_path / "cache", timeout=600)
    rows = json.loads(stdout.strip().splitlines()[-1])
    assert sorted((r["N"], r["retire"]) for r in rows) == [(n, t) for n in (16, 32, 64, 128) for t in (0, 1)]
    for r in rows:
        assert r["shapes"] == [f"64x{r['N']}x32"], r
        assert r["a_from_registers"], r  # RS, as frag8 feeds its decoded weights
        assert r["steps_in_loop"] >= 1 and r["loop_wgmmas"] == 8 * r["steps_in_loop"], r
        assert r["full_waits"] == (r["steps_in_loop"] if r["retire"] else 0), r
