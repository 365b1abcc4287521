"""`megamoe bench layer --replot JSON` redraws the committed GPU figures on a machine without a GPU,
for the ep_size-1 bench, the --ep N bench and --emulate (their JSONs differ: the replot picks the plot by them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_layer import main

# matplotlib is a test dependency (pyproject [test]): no skip, a missing one must fail here
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.mark.parametrize("name", ["h200_layer.json", "h200_layer_ep2.json", "h200_layer_ep4.json", "h200_layer_ep_emulated.json"])
def test_replot_draws_the_committed_results(name, tmp_path):
    out = tmp_path / "figure.png"
    assert main(["--replot", str(RESULTS / name), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
