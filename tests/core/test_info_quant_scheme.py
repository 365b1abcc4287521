"""`megamoe info` runs the scheme of tests/fixtures/quant_scheme_table.json for every (checkpoint, knob) pair.

The vLLM and SGLang plugins are held to the same table (tests/vllm/test_vllm_quant_scheme.py,
tests/sglang/test_sglang_quant_scheme.py): what info prints is what the engines would run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megamoe_backend.cli.main import main
from megamoe_backend.experts import A_OPERAND

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TABLE = json.loads((FIXTURES / "quant_scheme_table.json").read_text())["rows"]


def _env(monkeypatch, row: dict, wire: str) -> None:
    for name in ("MEGA_DISPATCH_WIRE", "MEGA_WIRE", "MEGA_COMBINE_WIRE", "MEGA_DISPATCH", "AITER_FORCE_A8W4"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MEGA_DISPATCH_WIRE", wire)
    if row["AITER_FORCE_A8W4"] is not None:
        monkeypatch.setenv("AITER_FORCE_A8W4", row["AITER_FORCE_A8W4"])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("row", TABLE, ids=lambda r: f"{r['checkpoint']}-force={r['AITER_FORCE_A8W4']}")
def test_info_runs_the_table_scheme_with_its_quantised_wire(row, device, monkeypatch, capsys) -> None:
    # The quantised wire that matches the expected scheme (fp8 for A8W4: AITER_FORCE_A8W4=1 makes it legal).
    wire = (A_OPERAND.get(row["scheme"]) or "bf16") if row["scheme"] != "refused" else "bf16"
    _env(monkeypatch, row, wire)
    rc = main(["info", "--model", str(FIXTURES / row["checkpoint"]), "--device", device, "--json"])
    out = capsys.readouterr().out
    if row["scheme"] == "refused":
        assert rc == 2 and "block-FP8 routed experts" in out, out
        return
    assert rc == 0, out
    info = json.loads(out)
    assert info["spec"]["quant"] == row["scheme"]
    assert f"quant={row['scheme']} " in info["startup_line"] and f"wire={wire} " in info["startup_line"]


@pytest.mark.parametrize("device", ["cpu", "cuda", "rocm"])
def test_force_a8w4_fp8_wire_for_dsv4_preset(device, monkeypatch, capsys) -> None:
    """The issue's command: refused on every --device before; A8W4 with the fp8 wire now."""
    _env(monkeypatch, {"AITER_FORCE_A8W4": "1"}, "fp8")
    assert main(["info", "--preset", "dsv4-pro", "--device", device]) == 0
    out = capsys.readouterr().out
    assert "a8w4 (checkpoint a4w4, AITER_FORCE_A8W4=1)" in out and "quant=a8w4" in out and "wire=fp8 " in out


def test_without_the_knob_fp8_wire_is_still_refused_for_a4w4(monkeypatch, capsys) -> None:
    _env(monkeypatch, {"AITER_FORCE_A8W4": None}, "fp8")
    assert main(["info", "--preset", "dsv4-pro", "--device", "cpu"]) == 2
    assert "allowed for this model: bf16 or fp4" in capsys.readouterr().out
