"""Helpers for the vLLM plugin tests: run one engine configuration in a subprocess, compare runs.

Engine runs go through ``engine_run.py`` in a subprocess (one vLLM engine per process) and are
cached per session by ``EngineCache``, so a configuration used by several tests starts one engine.
Kept out of conftest.py so test modules can import it by a name no other test directory uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class EngineResult:
    returncode: int
    log: str
    data: dict | None
    seconds: float

    @property
    def tokens(self) -> list[list[int]]:
        assert self.data is not None, self.log[-4000:]
        return self.data["tokens"]

    @property
    def forced(self) -> list[list[float]]:
        assert self.data is not None, self.log[-4000:]
        return self.data["forced"]


AMX_SITE = HERE / "amx_site"  # sitecustomize.py: AMX permission for every engine process (see there)


def engine_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGA_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(AMX_SITE), env.get("PYTHONPATH", "")) if p)
    return env


def run_engine(model: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 900) -> EngineResult:
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(HERE / "engine_run.py"), str(model), *args], env=env or engine_env(),
                          capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    log_dir = os.environ.get("MEGAMOE_TEST_LOG_DIR")  # keep every engine's log for CI debugging
    if log_dir:
        name = "_".join([Path(model).name, *args, *sorted(f"{k}={v}" for k, v in (env or {}).items()
                                                          if k.startswith(("MEGA_", "VLLM_PLUGINS")))])
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / (name.replace("/", "_").replace(" ", "") + ".log")).write_text(log)
    data = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            data = json.loads(line[len("RESULT "):])
    return EngineResult(proc.returncode, log, data, time.time() - t0)


class EngineCache:
    """Each (model, args, knobs) configuration starts one engine per test session."""

    def __init__(self, models: dict[str, Path]) -> None:
        self.models = models
        self._runs: dict[tuple, EngineResult] = {}

    def get(self, model: str, *args: str, **knobs: str) -> EngineResult:
        key = (model, args, tuple(sorted(knobs.items())))
        if key not in self._runs:
            self._runs[key] = run_engine(self.models[model], *args, env=engine_env(**knobs))
        return self._runs[key]


NEAR_TIE_NATS = 0.25


def greedy_agreement(base: EngineResult, other_tokens: list[list[int]], other_top2: list[list[dict]]) -> tuple[int, list]:
    """Compare greedy runs the way vLLM's own logprob checks do.

    Tokens must be identical until a prompt's first divergence; a divergence is accepted only as a
    near-tie — each run's token is in the other's top-2 and the two are within NEAR_TIE_NATS in
    both runs — and that prompt is not compared further (its contexts differ from there on).
    Returns (identical steps, [(prompt, step, margin_base, margin_other)]); raises on a real split.
    """
    same, ties = 0, []
    for p, (ta, tb) in enumerate(zip(base.tokens, other_tokens)):
        assert len(ta) == len(tb), (p, ta, tb)
        for s, (a, b) in enumerate(zip(ta, tb)):
            if a == b:
                same += 1
                continue
            top_a, top_b = base.data["top2"][p][s], other_top2[p][s]
            ok = str(b) in top_a and str(a) in top_b
            m_a = abs(top_a[str(a)] - top_a[str(b)]) if ok else float("inf")
            m_b = abs(top_b[str(a)] - top_b[str(b)]) if ok else float("inf")
            assert m_a < NEAR_TIE_NATS and m_b < NEAR_TIE_NATS, (
                f"prompt {p} step {s}: {a} vs {b} is not a near-tie (margins {m_a:.3f}, {m_b:.3f})")
            ties.append((p, s, round(m_a, 3), round(m_b, 3)))
            break
    return same, ties
