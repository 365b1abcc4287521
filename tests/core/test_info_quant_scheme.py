"""`megamoe info --engine E` runs the scheme and wire of tests/fixtures/quant_scheme_table.json for every row.

The vLLM and SGLang plugins are held to the same rows (tests/vllm/test_vllm_quant_scheme.py, in each vLLM
release's venv; tests/sglang/test_sglang_quant_scheme.py): what info prints for an engine release is what
that release's plugin runs, the engine's reading of the checkpoint included.

Planted mutation (run once, then restored): ``VLLM_FIRST_MXFP8_RELEASE = (0, 99)`` in
megamoe_backend/spec/engine_reading.py (info no longer knows vLLM 0.33+ reads V4 fp4 experts as A8W4):
25 failed (the 6 vllm-0.33 / vllm-0.34 V4 fp4 rows whose answer the reading changes, on cpu and cuda, and
the override-line test), 159 passed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megamoe_backend.cli.main import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TABLE = json.loads((FIXTURES / "quant_scheme_table.json").read_text())["rows"]
V4_FP4 = str(FIXTURES / "dsv4_pro_fp4_experts_config.json")


def row_id(row: dict) -> str:
    return f"{row['engine']}-{row['checkpoint']}-force={row['AITER_FORCE_A8W4']}-wire={row['MEGA_DISPATCH_WIRE']}"


def set_env(monkeypatch, force: str | None, wire: str | None) -> None:
    for name in ("MEGA_DISPATCH_WIRE", "MEGA_WIRE", "MEGA_COMBINE_WIRE", "MEGA_DISPATCH", "AITER_FORCE_A8W4"):
        monkeypatch.delenv(name, raising=False)
    if force is not None:
        monkeypatch.setenv("AITER_FORCE_A8W4", force)
    if wire is not None:
        monkeypatch.setenv("MEGA_DISPATCH_WIRE", wire)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("row", TABLE, ids=row_id)
def test_info_runs_the_table_row(row, device, monkeypatch, capsys) -> None:
    set_env(monkeypatch, row["AITER_FORCE_A8W4"], row["MEGA_DISPATCH_WIRE"])
    rc = main(["info", "--model", str(FIXTURES / row["checkpoint"]), "--device", device, "--engine", row["engine"],
               "--json"])
    out = capsys.readouterr().out
    if row["scheme"] == "refused":
        assert rc == 2 and row["refusal"] in out, out
        return
    if device != "cpu" and row["gpu_refusal"]:  # block-FP8: the CPU runs it, no GPU experts provider does yet
        assert rc == 2 and row["gpu_refusal"] in out, out
        return
    assert rc == 0, out
    info = json.loads(out)
    assert info["engine"] == row["engine"]
    assert (info["spec"]["quant"], info["scheme"]["dispatch_wire"], info["scheme"]["overridden_by"]) == (
        row["scheme"], row["wire"], row["overridden_by"])
    assert f"quant={row['scheme']} " in info["startup_line"] and f"wire={row['wire']} " in info["startup_line"]


def test_info_prints_the_override_line_only_where_a_knob_overrode_the_reading(monkeypatch, capsys) -> None:
    set_env(monkeypatch, "0", None)
    assert main(["info", "--model", V4_FP4, "--device", "cuda", "--engine", "vllm-0.33"]) == 0
    out = capsys.readouterr().out
    assert ("the engine's reading of the checkpoint (vLLM 0.33 DeepseekV4FP8Config: Mxfp4MoEMethod(activation_key="
            "kMxfp8Dynamic): a8w4) is overridden by AITER_FORCE_A8W4=0: experts run a4w4, dispatch wire bf16") in out
    assert main(["info", "--model", V4_FP4, "--device", "cuda", "--engine", "vllm-0.32"]) == 0
    assert "overridden" not in capsys.readouterr().out  # 0.32 names no activation format: nothing to override


def test_info_without_engine_is_the_checkpoints_own_reading(monkeypatch, capsys) -> None:
    """No --engine: the config.json alone (V4 fp4 experts declare no activation format: A4W4, bf16 wire)."""
    set_env(monkeypatch, None, None)
    assert main(["info", "--model", V4_FP4, "--device", "cuda", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["engine"], info["engine_reading"], info["spec"]["quant"], info["scheme"]["dispatch_wire"]) == (
        None, None, "a4w4", "bf16")


@pytest.mark.parametrize("args, needle", [
    (["--preset", "dsv4", "--engine", "vllm-0.33"], "--preset 'dsv4' is not a preset; available: dsv4-pro, r1-fp8, r1-mxfp4"),
    (["--model", V4_FP4, "--engine", "ollama-1"], "--engine 'ollama-1': expected ENGINE-VERSION"),
])
def test_info_engine_refusals_name_the_flag(args, needle, monkeypatch, capsys) -> None:
    set_env(monkeypatch, None, None)
    assert main(["info", *args]) == 2
    assert needle in capsys.readouterr().out


@pytest.mark.parametrize("device", ["cpu", "cuda", "rocm"])
def test_force_a8w4_fp8_wire_for_dsv4_preset(device, monkeypatch, capsys) -> None:
    """The issue's command: refused on every --device before; A8W4 with the fp8 wire now."""
    set_env(monkeypatch, "1", "fp8")
    assert main(["info", "--preset", "dsv4-pro", "--device", device]) == 0
    out = capsys.readouterr().out
    assert "a8w4 (checkpoint a4w4, AITER_FORCE_A8W4=1)" in out and "quant=a8w4" in out and "wire=fp8 " in out


def test_without_the_knob_fp8_wire_is_still_refused_for_a4w4(monkeypatch, capsys) -> None:
    set_env(monkeypatch, None, "fp8")
    assert main(["info", "--preset", "dsv4-pro", "--device", "cpu"]) == 2
    assert "allowed for this model: bf16 or fp4" in capsys.readouterr().out
