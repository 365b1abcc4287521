"""Runs the interpreter modules (INTERPRETER_MODULES) in a
fresh process when this process cannot interpret Triton.

Why: Triton decides interpreted vs compiled when a function is decorated, its own standard library
included; a test elsewhere that imported Triton first (e.g. through an engine) leaves this process
unable to interpret, and the interpreter module then skips itself. Nothing runs twice: this test
skips whenever the in-process module can run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


INTERPRETER_MODULES = ("test_triton_interpreter.py", "test_device_forward_interpreter.py", "test_p2p_interpreter.py",
                       "test_watchdog_interpreter.py", "test_live_interpreter.py", "test_block_fp8_interpreter.py",
                       "../rocm/test_mori_device_forward.py",
                       "../experts_humming/test_humming_interpreter.py")  # paths from this folder


@pytest.mark.parametrize("module", INTERPRETER_MODULES)
def test_interpreter_suite_in_fresh_process(module):
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: tests/kernels/test_gpu_experts.py covers the kernels")
    import triton.language.standard as std

    if type(std._elementwise_max).__name__ == "InterpretedFunction":
        pytest.skip(f"this process interprets Triton: {module} ran in-process")
    target = Path(__file__).parent / module
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(target)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
