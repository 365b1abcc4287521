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
    capture_dir: Path | None = None  # MegaMoE layer calls recorded by capture_site (None: not recorded)

    @property
    def tokens(self) -> list[list[int]]:
        assert self.data is not None, self.log[-4000:]
        return self.data["tokens"]

    @property
    def forced(self) -> list[list[float]]:
        assert self.data is not None, self.log[-4000:]
        return self.data["forced"]


AMX_SITE = HERE / "amx_site"  # sitecustomize.py: AMX permission for every engine process (see there)
CAPTURE_SITE = HERE / "capture_site"  # test-only vLLM plugin recording layer calls / token bounds (see there)


def engine_env(capture_dir: Path | None = None, bound_dir: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGA_", "MEGAMOE_TEST_"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", **extra)
    sites = [str(AMX_SITE)]
    if capture_dir is not None or bound_dir is not None:
        sites.append(str(CAPTURE_SITE))
    if capture_dir is not None:
        env["MEGAMOE_TEST_CAPTURE_DIR"] = str(capture_dir)
    if bound_dir is not None:
        env["MEGAMOE_TEST_BOUND_DIR"] = str(bound_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*sites, env.get("PYTHONPATH", "")) if p)
    return env


def run_engine(model: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 900,
               capture_dir: Path | None = None) -> EngineResult:
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
    return EngineResult(proc.returncode, log, data, time.time() - t0, capture_dir)


class EngineCache:
    """Each (model, args, knobs) configuration starts one engine per test session.

    Every run records its MegaMoE layer calls (if any) under ``capture_root`` for the exact-oracle
    test; recording copies tensors and changes no number the engine computes.
    """

    def __init__(self, models: dict[str, Path], capture_root: Path) -> None:
        self.models = models
        self.capture_root = capture_root
        self._runs: dict[tuple, EngineResult] = {}

    def get(self, model: str, *args: str, **knobs: str) -> EngineResult:
        key = (model, args, tuple(sorted(knobs.items())))
        if key not in self._runs:
            capture = self.capture_root / f"run{len(self._runs)}"
            self._runs[key] = run_engine(self.models[model], *args, env=engine_env(capture, **knobs),
                                         capture_dir=capture)
        return self._runs[key]


def greedy_agreement(base: EngineResult, other_tokens: list[list[int]], other_top2: list[list[dict]]) -> tuple[int, list]:
    """Compare greedy runs the way vLLM's own logprob checks do.

    Tokens must be identical until a prompt's first divergence; a divergence is accepted only as a
    top-2 swap — each run's token is the other run's runner-up — and that prompt is not compared
    further (its contexts differ from there on). No margin threshold: how close the two candidates
    are at a split depends on which CPU's bf16 kernels produced the logits (a fitted margin failed
    on a new machine); a swap of the two best candidates is what two correct implementations that
    differ by rounding can produce, and anything else (a third token, a token the other run ranks
    low) is a real split. The numbers are checked elsewhere: the exact layer oracle and the derived
    mean-logprob bound (test_engine.py). Returns (identical steps, [(prompt, step, margin_base,
    margin_other)]); raises on a real split.
    """
    same, ties = 0, []
    for p, (ta, tb) in enumerate(zip(base.tokens, other_tokens, strict=True)):
        assert len(ta) == len(tb), (p, ta, tb)
        for s, (a, b) in enumerate(zip(ta, tb)):
            if a == b:
                same += 1
                continue
            top_a, top_b = base.data["top2"][p][s], other_top2[p][s]
            assert str(b) in top_a and str(a) in top_b, (
                f"prompt {p} step {s}: {a} vs {b} is not a top-2 swap (top-2 {top_a} vs {top_b})")
            ties.append((p, s, round(abs(top_a[str(a)] - top_a[str(b)]), 3), round(abs(top_b[str(a)] - top_b[str(b)]), 3)))
            break
    return same, ties
