"""Helpers shared by tests/sglang (imported by name; conftest.py holds only the fixtures)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
FIXTURES = HERE.parent / "fixtures"
REPO = HERE.parent.parent


def run_python(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=full_env)


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


SCRIPT_VARS = ("N", "DP", "WIRE", "COMBINE_WIRE", "TRANSPORT", "MTPR", "PORT", "HOST", "MODEL", "BACKEND", "PRESET",
               "KV_CACHE", "MAX_MODEL_LEN", "CUDA_GRAPH", "CHECK", "MEGAMOE", "DEVICE", "DATASET", "DATASET_PATH", "ISL",
               "OSL", "CONCURRENCY", "PROMPTS", "NUM_PROMPTS", "REQUEST_RATE", "WARMUPS", "SEED", "POINT", "RESULT_DIR",
               "LM_EVAL", "PYTHON", "EPLB", "EPLB_WINDOW", "EPLB_INTERVAL", "EPLB_THRESHOLD")


def dry_run(script: str, env: dict | None = None, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run a scripts/*.sh in --dry-run mode with a clean set of MEGA_* / script variables; the script's
    `megamoe info` check runs this venv's megamoe (CHECK=1 in ``env`` turns it on; off by default)."""
    clean = {k: v for k, v in os.environ.items()
             if k not in SCRIPT_VARS and not k.startswith(("MEGA_", "SGLANG_PLUGINS", "AITER_"))}
    bin_dir = Path(sys.executable).parent
    clean.update({"PATH": f"{bin_dir}{os.pathsep}{clean.get('PATH', '')}", "PYTHON": sys.executable, "CHECK": "0",
                  "DEVICE": "cuda"})
    return subprocess.run(["bash", str(REPO / "scripts" / script), "--dry-run", *args], capture_output=True,
                          text=True, env={**clean, **(env or {})}, timeout=60)


def printed_commands(proc: subprocess.CompletedProcess) -> list[list[str]]:
    """The command lines a dry run printed, split as the shell splits them (serve: env line dropped)."""
    lines = proc.stdout.splitlines()
    if lines and lines[0].split()[0] == "env":
        lines = lines[1:]
    return [shlex.split(line) for line in lines]
