"""Put Triton into interpreter mode on CPU-only machines before any test here imports it (as
tests/kernels/conftest.py does): the provider's own kernels run under the interpreter, humming's
GEMMs are emulated (emulation.py). On a GPU machine test_gpu_humming.py runs the real ones."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))
