"""The expert GEMMs compiled for sm_90a (no GPU needed: Triton's own ptxas / nvdisasm) keep their
wgmma pipeline, for the default tile of every token bucket of the frag8 decoder (the GPU default for
A8W4 / A4W4), the frag decoder (bf16 activations, or weights frag8 cannot fold) and the split
decoder (row-major MXFP4 that the fragment layouts refuse): ptxas does not serialise the wgmmas
(info C7515), the frag / frag8 K loops wait for their wgmmas once per K step (no more), and no
instruction overwrites a register that an unfinished wgmma still reads.

Why: when LLVM keeps a zero-trip path that writes the accumulators, ptxas serialises the loop (one
full wait after every wgmma; 25-42 % of frag GEMM1's stall samples on the H200). That happened to
frag GEMM1 at the mid / prefill tiles (commit ce681ac) and to split GEMM1 (mid) / GEMM2 (prefill)
up to commit 8873e5a; `mainloop.assume_k_loop_runs`, called by both kernels, removes it.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton", reason="the sm_90a report compiles the Triton kernels (CI installs triton)")
from sm90a_script import run_sm90a_script  # noqa: E402


@pytest.fixture(scope="module")
def sass_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("sass") / "rows.json"
    run_sm90a_script("sass_report.py", ["--json", str(out)], out.parent / "cache", timeout=900)
    return json.loads(out.read_text())


def test_every_bucket_compiles_both_gemms(sass_rows):
    from megamoe_backend.experts.triton.config import BUCKETS, FRAG8_BUCKETS, FRAG_BUCKETS

    def passes(c):
        return ("full",) + (("short",) if c.tail_m else ()) + (("ride",) if c.tail_ride else ())

    launches = [p for t in (FRAG_BUCKETS, FRAG8_BUCKETS, BUCKETS) for _, c in t for p in passes(c)]
    plain = [r for r in sass_rows if not r["persist"] and not r["dest"]]
    assert len(plain) == 2 * len(launches)
    assert sum(r["pass"] == "ride" for r in plain) == 2 * launches.count("ride") > 0  # the prefill riders
    assert sum(r["pass"] == "short" for r in plain) == 2 * launches.count("short") > 0  # mid / prefill short tiles
    # the EP forward's persistent launches over live tiles (no bound passed): every frag8 pass, both GEMMs
    persistent = [r for r in sass_rows if r["persist"] and r["out"] != "fp8"]
    assert len(persistent) == 2 * sum(len(passes(c)) for _, c in FRAG8_BUCKETS) and {r["decoder"] for r in persistent} == {"frag8"}
    for row in sass_rows:
        assert row["loop_hgmma"] > 0, row  # the K loop really runs on wgmma (not an mma.sync fallback)
    assert {r["decoder"] for r in sass_rows} == {"frag", "frag8", "split"}


def test_gemms_wait_for_their_predecessor_first(sass_rows):
    """Hopper launches both GEMMs with programmatic dependent launch (experts/triton/pdl.py): their
    programs may start while the kernel before them runs, so griddepcontrol.wait must come before any
    memory access (a layout or A2 read before it would race the predecessor's writes)."""
    assert sass_rows
    for row in sass_rows:
        assert row["pdl_wait_first"] is True, row


def test_wgmma_pipeline_not_serialised(sass_rows):
    for row in sass_rows:
        assert not row["wgmma_serialized"], row
        # one full wait per K step: frag / frag8 retire the step's wgmmas before the next decode
        # (mainloop._retire; the ride loop's two dots may wait twice), split waits once for its two dots
        assert row["loop_full_wgmma_waits"] <= (2 if row["pass"] == "ride" else 1), row


def test_no_register_operand_overwritten_in_flight(sass_rows):
    """The fragment decoders' wgmmas read W from registers; no instruction of the K loop (back edge
    included) may write a register that an issued, unretired wgmma reads (PTX: undefined). Without
    mainloop._retire every frag / frag8 loop had such writes (2-89 per loop), and on the H200 the
    frag8 GEMM2 with the bf16 wire epilogue gave wrong, run-dependent columns at 8192 tokens."""
    rows = [r for r in sass_rows if r["decoder"] in ("frag", "frag8")]
    assert rows
    for row in rows:
        assert row["loop_inflight_a_writes"] == 0, row


def test_short_tile_launches_fit_their_register_cap(sass_rows):
    """A short-tile launch runs under its own register cap (TileConfig.tail_max_registers: 128 at mid
    sizes, four CTAs per SM) and must not spill there: a kernel change that needs more registers
    would otherwise trade the fourth CTA for local-memory traffic without a word."""
    from megamoe_backend.experts.triton.config import FRAG8_BUCKETS

    mid = next(c for _, c in FRAG8_BUCKETS if c.tail_max_registers)
    shorts = [r for r in sass_rows if r["pass"] == "short"]
    assert shorts
    for row in shorts:
        assert row["spill_bytes"] == 0, row
    capped = [r for r in shorts if r["decoder"] == "frag8" and r["config"][0] == mid.block_m and not r["persist"]]
    # GEMM1, GEMM2 at pair indices, GEMM2 into the combine regions on either wire (persistent: uncapped)
    assert len(capped) == 4 and all(r["registers"] <= mid.tail_max_registers for r in capped), capped


def test_decode_loop_stays_lean(sass_rows):
    """Instructions per decoded weight in the K loop: frag8 2.0-2.6 today (PRMT table decode, k32
    wgmmas), frag 2.8-3.6, split (the row-major fallback) ~6."""
    limit = {"frag8": 3.0, "frag": 4.0, "split": 7.0}
    for row in sass_rows:
        assert row["loop_instructions_per_weight"] < limit[row["decoder"]], row


def test_gemm2_into_the_combine_regions_does_not_spill(sass_rows):
    """GEMM2 as the P2P forward runs it (DEST 2: each pair's row into its source's combine region, bases
    loaded on the device) with the bound (tile grid) or without (persistent), bf16 and fp8 combine wires.
    Without the alignment the workspace promises (SegmentDest.align, gemm2._row_offsets) ptxas stored
    element by element with a 64-bit address each and spilled 848-4632 bytes in the mid and prefill
    launches (H200, EP 8 x 128 tokens: GEMM2 230 us where the same tiles at pair indices take 152)."""
    from megamoe_backend.experts.triton.config import FRAG8_BUCKETS
    from megamoe_backend.experts.triton.launch_plan import tile_passes

    rows = [r for r in sass_rows if r["kernel"] == "gemm2" and r["dest"] == 2]
    launches = sum(len(tile_passes(c, "frag8")) for _, c in FRAG8_BUCKETS)
    assert len(rows) == 4 * launches  # grid bf16 / fp8, persistent bf16 / fp8
    for row in rows:
        assert row["spill_bytes"] <= 256, row  # 0 but the prefill ride / persistent launches (16-176 bytes)
