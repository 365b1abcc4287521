"""Helpers shared by tests/sglang (imported by name; conftest.py holds only the fixtures)."""

from __future__ import annotations

import json
import os
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


def dry_run(script: str, env: dict | None = None, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run a scripts/*.sh in --dry-run mode with a clean set of MEGA_* / script variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MEGA_", "SGLANG_PLUGINS"))}
    for k in ("N", "WIRE", "COMBINE_WIRE", "TRANSPORT", "MTPR", "PORT", "HOST", "MODEL", "ISL", "OSL", "PROMPTS",
              "CONCURRENCY", "OUT", "PYTHON", "CUDA_GRAPH", "EPLB", "EPLB_WINDOW", "EPLB_INTERVAL", "EPLB_THRESHOLD"):
        clean.pop(k, None)
    return subprocess.run(["bash", str(REPO / "scripts" / script), "--dry-run", *args], capture_output=True,
                          text=True, env={**clean, **(env or {})}, timeout=60)
