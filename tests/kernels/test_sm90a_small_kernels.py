"""The EP forward's small kernels (dispatch, MX quantisation, the layout's chunk kernels; each in the
variants the forwards launch, over live rows too) compile for sm_90a with Triton's own ptxas, without
spilling. The interpreter tests run their logic; this is what a GPU would compile
(benchmarks/research/sm90a_small_kernels.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton", reason="compiles the Triton kernels (CI installs triton)")
from sm90a_script import run_sm90a_script  # noqa: E402


def test_the_small_kernels_compile_for_sm90a_without_spills(tmp_path):
    out = tmp_path / "small.json"
    run_sm90a_script("sm90a_small_kernels.py", ["--json", str(out)], tmp_path / "cache", timeout=900)
    rows = json.loads(out.read_text())
    names = {r["kernel"] for r in rows}
    assert {"dispatch fp8 x8", "dispatch fp8 x32", "dispatch fp4 x32", "quantize fp4 live rows", "layout histogram live rows", "layout scatter live rows"} <= names
    assert all("error" not in r for r in rows), [r for r in rows if "error" in r]
    assert all(r["spill_bytes"] == 0 and 0 < r["registers"] <= 255 for r in rows), rows
