"""The README's "vs what each engine runs" table is the committed experts record read by benchmarks/engine_ratios.py.

Every figure of that table (MegaMoE's µs with the GEMMs auto picks, its ratio to vLLM's and SGLang's defaults,
naive torch, the measured floor) is recomputed from benchmarks/results/h100_experts_humming_peers.json, so an
edited number or a new record that no longer agrees fails here instead of standing in front of users.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from benchmarks.engine_ratios import ratio, rows

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "benchmarks" / "results" / "h100_experts_humming_peers.json"
ROW = re.compile(r"^\| (\d+) \| (\d+) \| ([\d.]+)x \| ([\d.]+)x \| ([\d.]+)x \| (\d+) \| (\d+) \|$", re.M)
PROVIDER = "humming"  # the GEMMs MEGA_EXPERTS_GEMM=auto runs at ep_size 1 on an H100 with humming-kernels


def readme_rows() -> dict[int, tuple]:
    section = (ROOT / "README.md").read_text().split("## Versus what you run today")[1].split("\n## ")[0]
    return {int(m[0]): m[1:] for m in ROW.findall(section)}


def record_rows(record: dict, experts: int = 48) -> dict[int, tuple]:
    out = {}
    for r in rows(record):
        if r["experts"] != experts:
            continue
        mine, peers = r.get(PROVIDER), r["peers"]
        out[r["tokens"]] = (f"{mine:.0f}", *(f"{ratio(mine, peers.get(p)):.2f}" for p in
                                            ("vllm_humming", "flashinfer_w4a16", "flashinfer_humming")),
                            f"{r['torch']:.0f}", f"{r['floor_measured_us']:.0f}")
    return out


def test_readme_table_is_the_record():
    quoted = readme_rows()
    assert sorted(quoted) == [8, 128, 1024, 8192], quoted
    assert quoted == record_rows(json.loads(RECORD.read_text()))


def test_a_changed_record_disagrees():
    record = copy.deepcopy(json.loads(RECORD.read_text()))
    for p in record["peers"]:
        if p["peer"] == "vllm_humming" and p["tokens"] == 8192 and p["experts"] == 48:
            p["us"] *= 0.8  # planted: vLLM's default 20 % faster at prefill
    assert readme_rows() != record_rows(record)
