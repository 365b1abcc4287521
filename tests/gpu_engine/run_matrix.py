"""Run a list of GPU engine configurations, each in its own process, into one JSON file.

Why a driver: one device call has minutes, and every vLLM configuration needs a fresh process
(``serve_one.py``). The driver builds the tiny checkpoints once (tests/vllm/tiny_model.py), runs
each configuration with a time limit, keeps its log, and writes everything the checks need
(``gpu_engine_checks.py`` reads it, on the GPU machine or later on any CPU).

A run is ``NAME=MODEL:BACKEND:GRAPHS[:VAR=VALUE,...]``: MODEL one of ``bf16 twin a8w4 a4w4 fp8 fp8twin``,
BACKEND ``default`` or ``megamoe_ep``, GRAPHS a ``serve_one.GRAPH_MODES`` entry, then extra
environment (e.g. ``MEGA_DISPATCH_WIRE=fp8``; ``TRITON_CACHE_DIR=fresh`` gives the run an empty
Triton cache of its own, for cold start-up times).

Usage: python tests/gpu_engine/run_matrix.py --out results.json --deadline-s 540 RUN [RUN ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm"))

MODELS = {"bf16": dict(quant="bf16"), "twin": dict(quant="bf16", mxfp4_values=True),
          "a8w4": dict(quant="a8w4"), "a4w4": dict(quant="a4w4"),
          # DeepSeek V3 / R1 block-FP8 routed experts, and the bf16 checkpoint holding their dequantised values
          "fp8": dict(quant="fp8_block"), "fp8twin": dict(quant="bf16", block_fp8_values=True)}
STARTUP = "[megamoe] Created MegaMoE:"


@dataclass
class RunSpec:
    name: str
    model: str
    backend: str
    graphs: str
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "RunSpec":
        name, _, rest = text.partition("=")
        parts = rest.split(":")
        if len(parts) < 3 or parts[0] not in MODELS or parts[1] not in ("default", "megamoe_ep"):
            raise SystemExit(f"run {text!r}: expected NAME=MODEL:BACKEND:GRAPHS[:VAR=VALUE,...] with MODEL in "
                             f"{sorted(MODELS)} and BACKEND default | megamoe_ep")
        env = dict(kv.split("=", 1) for kv in parts[3].split(",")) if len(parts) > 3 and parts[3] else {}
        return cls(name, parts[0], parts[1], parts[2], env)


def build_models(root: Path, names: set[str]) -> dict[str, Path]:
    from tiny_model import build_tiny_deepseek

    return {n: build_tiny_deepseek(root / n, **MODELS[n]) for n in sorted(names)}


def run_one(spec: RunSpec, model_dir: Path, timeout_s: float, log_dir: Path) -> dict:
    env = dict(os.environ)
    for key, value in spec.env.items():
        env[key] = tempfile.mkdtemp(prefix="triton-cold-") if (key == "TRITON_CACHE_DIR" and value == "fresh") else value
    cmd = [sys.executable, str(HERE / "serve_one.py"), str(model_dir), "--graphs", spec.graphs]
    if spec.backend != "default":
        cmd += ["--moe-backend", spec.backend]
    t0 = time.time()
    log_path = log_dir / f"{spec.name}.log"
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log_path.read_text(errors="replace")
    result = next((json.loads(line[len("RESULT "):]) for line in reversed(text.splitlines())
                   if line.startswith("RESULT ")), None)
    return {"spec": spec.__dict__, "rc": rc, "wall_s": round(time.time() - t0, 1), "result": result,
            "startup_lines": [line[line.index(STARTUP):] for line in text.splitlines() if STARTUP in line],
            "log_tail": text[-6000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline-s", type=float, default=540.0, help="stop starting runs past this (whole driver)")
    ap.add_argument("--run-timeout-s", type=float, default=240.0)
    ap.add_argument("--models", default=None, help="folder for the checkpoints (default: a temporary one)")
    args = ap.parse_args()
    t0 = time.time()
    specs = [RunSpec.parse(r) for r in args.runs]
    root = Path(args.models or tempfile.mkdtemp(prefix="gpu-engine-models-"))
    models = build_models(root, {s.model for s in specs})
    log_dir = Path(tempfile.mkdtemp(prefix="gpu-engine-logs-"))
    out = {"meta": {"models": {k: str(v) for k, v in models.items()}, "started": time.strftime("%Y-%m-%d %H:%M:%S")},
           "runs": {}}
    try:
        import torch

        out["meta"]["card"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no cuda"
        out["meta"]["torch"] = torch.__version__
        import vllm

        out["meta"]["vllm"] = vllm.__version__
    except Exception as exc:  # noqa: BLE001 - the meta block records what it could not read
        out["meta"]["error"] = repr(exc)
    for spec in specs:
        left = args.deadline_s - (time.time() - t0)
        if left < 30:
            out["runs"][spec.name] = {"spec": spec.__dict__, "rc": "not run: deadline"}
            continue
        rec = run_one(spec, models[spec.model], min(args.run_timeout_s, left - 10), log_dir)
        out["runs"][spec.name] = rec
        ok = rec["result"] is not None
        print(f"{spec.name:28s} rc={rec['rc']} {rec['wall_s']:6.1f}s {'ok' if ok else 'FAILED'} "
              f"{(rec['result'] or {}).get('op_calls', '')}", flush=True)
        if not ok:
            print(rec["log_tail"][-2500:], flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
