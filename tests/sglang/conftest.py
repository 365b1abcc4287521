"""tests/sglang runs in the SGLang venv (.ci/install_sglang.sh): real sglang 0.5.23, CPU torch.

Without sglang installed (the main venv) the test modules here are not collected.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sglang_test_env import FIXTURES, HERE, dry_run, load_json, printed_commands, run_python  # noqa: E402

try:
    from importlib.metadata import version

    SGLANG_VERSION = version("sglang")
except Exception:  # PackageNotFoundError
    SGLANG_VERSION = None

collect_ignore_glob = [] if SGLANG_VERSION else ["test_*.py"]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[int, Path]:
    """Local model folders holding only a DeepSeek config.json, with 8 and 6 routed experts."""
    base = json.loads((FIXTURES / "r1_mxfp4_config.json").read_text())
    base.pop("quantization_config", None)
    out = {}
    for n in (8, 6):
        d = tmp_path_factory.mktemp(f"dsv3_{n}e")
        (d / "config.json").write_text(json.dumps({**base, "n_routed_experts": n, "num_experts_per_tok": 2}))
        out[n] = d
    return out


@pytest.fixture(scope="session")
def script_argv(model_dirs) -> dict[str, list[str]]:
    """`sglang serve` argv printed by each serve script's dry run (model path = a local config dir)."""
    out = {}
    for name, script, env in (
        ("dsv4", "serve_sglang_dsv4_pro_ep.sh", {"N": "8"}),
        ("r1", "serve_sglang_r1_mxfp4_ep.sh", {"N": "4", "WIRE": "fp4"}),
        ("r1_eplb", "serve_sglang_r1_mxfp4_ep.sh", {"N": "4", "WIRE": "fp4", "EPLB": "r64"}),
        ("r1_ref", "serve_sglang_r1_mxfp4_ep.sh", {"PRESET": "reference"}),
        ("r1_ref_default", "serve_sglang_r1_mxfp4_ep.sh", {"PRESET": "reference", "BACKEND": "default"}),
    ):
        proc = dry_run(script, {**env, "MODEL": str(model_dirs[8])})
        assert proc.returncode == 0, proc.stderr
        (cmd,) = printed_commands(proc)
        assert cmd[:2] == ["sglang", "serve"], cmd
        out[name] = cmd[2:]
    # the bench script's reference points and ShareGPT run (parsed by sglang.benchmark.serving's own parser)
    proc = dry_run("bench_sglang_serve.sh", {"PRESET": "reference", "MODEL": str(model_dirs[8])})
    assert proc.returncode == 0, proc.stderr
    share = dry_run("bench_sglang_serve.sh", {"PRESET": "reference", "DATASET": "sharegpt", "DATASET_PATH": "/d/sg.json"})
    assert share.returncode == 0, share.stderr
    for i, cmd in enumerate(printed_commands(proc) + printed_commands(share)):
        assert cmd[1:3] == ["-m", "sglang.benchmark.serving"], cmd
        out[f"bench:{i}"] = cmd[3:]
    return out


@pytest.fixture(scope="session")
def checks(tmp_path_factory, model_dirs, script_argv) -> dict:
    """One SGLang process answering every server-argument question (sglang_cli_checks.py)."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "scripts.json").write_text(json.dumps(script_argv))
    proc = run_python([str(HERE / "sglang_cli_checks.py"), str(tmp / "cli.json"), str(model_dirs[8]),
                       str(model_dirs[6]), str(tmp / "scripts.json")])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return load_json(tmp / "cli.json")
