"""The EP forward's small kernels (dispatch, MX quantisation, the layout's kernels, frag8's row re-scales;
each in the variants the forwards launch, over live rows too) compile for sm_90a with Triton's own ptxas,
without spilling, and those launched with PDL wait for their predecessor first. The interpreter tests run their logic; this is what a GPU would compile
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
    assert {"dispatch fp8 x8", "dispatch fp8 x32", "dispatch fp4 x32", "quantize fp4 live rows", "quantize fp8 routed rows",
            "layout histogram live rows", "layout scatter live rows"} <= names
    assert all("error" not in r for r in rows), [r for r in rows if "error" in r]
    assert all(r["spill_bytes"] == 0 and 0 < r["registers"] <= 255 for r in rows), rows
    # the experts forward's kernels launch with programmatic dependent launch on Hopper (experts/triton/pdl.py): each
    # waits for its predecessor before its first memory access (a wait after one, or none, fails here)
    pdl = [r for r in rows if r["pdl"]]
    assert {"layout plan live rows", "layout scatter live rows", "rowscale e4m3 A live rows", "rowscale e4m3 A2 live rows"} <= {
        r["kernel"] for r in pdl}
    assert all(r["pdl_wait_first"] is True for r in pdl), [r for r in pdl if r["pdl_wait_first"] is not True]
