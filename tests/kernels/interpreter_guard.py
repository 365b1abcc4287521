"""The module-level guard of the interpreter test modules (one copy instead of one per module).

Skips the calling module on a CUDA machine (its GPU module covers it there) and when Triton was
already imported in compiled mode in this process (test_triton_interpreter_isolated.py then reruns
the module in a fresh process); otherwise leaves Triton in interpreter mode.
"""

from __future__ import annotations

import os

import pytest
import torch


def require_interpreter(gpu_module: str) -> None:
    if torch.cuda.is_available():
        pytest.skip(f"interpreter tests run on CPU-only machines; {gpu_module} covers CUDA", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    import triton.language.standard as std

    if type(std._elementwise_max).__name__ != "InterpretedFunction":
        pytest.skip("Triton was imported before TRITON_INTERPRET=1; test_triton_interpreter_isolated.py runs this "
                    "module in a fresh process", allow_module_level=True)
