"""Put Triton into interpreter mode on CPU-only machines before any test here imports it.

triton.jit picks interpreted vs compiled at decoration time, including Triton's own standard
library (tl.max's combine function...), so the switch must happen before the first ``import triton``.
If another test directory imported Triton earlier in the same pytest process, the in-process
interpreter tests skip and test_triton_interpreter_isolated.py reruns them in a fresh process.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
