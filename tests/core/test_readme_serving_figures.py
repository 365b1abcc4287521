"""The README's in-engine figures are the committed serving record's ratios (a claim with its source).

The README quotes megamoe_ep / vLLM default for the three workloads of benchmarks/vllm_serving.py; this
recomputes them from benchmarks/results/h100_vllm_serving.json, so a new record (or an edited line)
that no longer agrees fails here instead of leaving a stale number in front of users.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "benchmarks" / "results" / "h100_vllm_serving.json"
PATTERN = re.compile(r"decode of 64 requests \**([\d.]+)x\**, one\s+request \**([\d.]+)x\**, prefill \**([\d.]+)x\**")


def ratios(record: dict) -> tuple[float, float, float]:
    """(decode, one request, prefill): above 1 MegaMoE is faster (tokens/s up, ms per token down)."""
    mega, base = record["runs"]["megamoe_ep"]["workloads"], record["runs"]["default"]["workloads"]
    return (mega["decode"]["output_tok_s"] / base["decode"]["output_tok_s"],
            base["latency"]["ms_per_output_token"] / mega["latency"]["ms_per_output_token"],
            mega["prefill"]["prompt_tok_s"] / base["prefill"]["prompt_tok_s"])


def readme_ratios() -> tuple[float, float, float]:
    text = " ".join((ROOT / "README.md").read_text().split())
    m = PATTERN.search(text)
    assert m, "the README's in-engine line (decode / one request / prefill ratios) is gone or reworded"
    return tuple(float(x) for x in m.groups())


def agree(quoted, measured) -> bool:
    return all(abs(q - round(r, 2)) < 1e-9 for q, r in zip(quoted, measured, strict=True))


def test_readme_quotes_the_serving_record():
    record = json.loads(RECORD.read_text())
    assert "H100" in record["card"] and "Inside vLLM 0.34 on one H100" in (ROOT / "README.md").read_text()
    assert agree(readme_ratios(), ratios(record)), (readme_ratios(), ratios(record))


def test_a_changed_record_disagrees():
    record = copy.deepcopy(json.loads(RECORD.read_text()))
    record["runs"]["megamoe_ep"]["workloads"]["decode"]["output_tok_s"] *= 0.5  # planted: half the decode rate
    assert not agree(readme_ratios(), ratios(record))
