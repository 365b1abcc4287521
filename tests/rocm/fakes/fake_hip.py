"""Fake of the HIP runtime's last-error state (libamdhip64 ``hipGetLastError``), for CPU tests.

Why it exists: mori's cco ``Communicator.init`` probes fabric handles with ``hipMemCreate`` and,
where they are unsupported, leaves ``hipErrorNotSupported`` as the HIP last error; the next torch
call that checks the last error (an allocation) raises it. MoRI clears it itself only since
ROCm/mori#761 (no release yet); vLLM 0.34 clears it after every cco init
(vllm/distributed/device_communicators/all2all.py:1127-1131, ``CudaRTLibrary().cudaGetLastError()``).
The fake cco sets it (mori/cco.py), the fake MegaMoEGfx1250 raises it at construction (its first
allocation), and ``hipGetLastError`` returns and clears it as HIP does.
"""

HIP_SUCCESS = 0
HIP_ERROR_NOT_SUPPORTED = 801  # hipErrorNotSupported
LAST_ERROR = {"code": HIP_SUCCESS}
CALLS: list = []


def hipGetLastError() -> int:  # noqa: N802 (HIP's name)
    code = LAST_ERROR["code"]
    LAST_ERROR["code"] = HIP_SUCCESS
    CALLS.append(("hipGetLastError", code))
    return code


def raise_if_pending(where: str) -> None:
    """What torch's next error check does with a stale last error."""
    if LAST_ERROR["code"] != HIP_SUCCESS:
        raise RuntimeError(f"HIP error: operation not supported (hipErrorNotSupported {LAST_ERROR['code']}) in {where}")


def reset() -> None:
    LAST_ERROR["code"] = HIP_SUCCESS
    CALLS.clear()
