"""Load a cubin and launch its kernels through the CUDA driver API (ctypes on libcuda).

Why not a torch C++ extension: the kernels need no host code, and building one would compile torch's
headers on every GPU host (minutes) for what is one cuLaunchKernel. The launch goes on torch's current
stream, so it is ordered with the provider's Triton launches and captured by CUDA graphs like them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CudaDriverError(RuntimeError):
    pass


class _Lib:
    """libcuda.so.1, loaded once (a documented cache: the process has one driver)."""

    _handle: ctypes.CDLL | None = None

    @classmethod
    def get(cls) -> ctypes.CDLL:
        if cls._handle is None:
            cls._handle = ctypes.CDLL("libcuda.so.1")
        return cls._handle


def _check(result: int, what: str) -> None:
    if result != 0:
        lib = _Lib.get()
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(msg))
        raise CudaDriverError(f"{what} failed: CUDA error {result} ({(msg.value or b'?').decode()})")


class Kernel:
    """One __global__ function of a loaded module, with its dynamic shared memory raised once."""

    def __init__(self, func: ctypes.c_void_p, name: str, threads: int, smem_bytes: int) -> None:
        self.func, self.name, self.threads, self.smem_bytes = func, name, threads, smem_bytes
        _check(_Lib.get().cuFuncSetAttribute(func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes),
               f"cuFuncSetAttribute({name}, max dynamic shared memory {smem_bytes})")

    def launch(self, grid: int, params: ctypes.Structure, stream: int) -> None:
        """One launch of ``grid`` CTAs; ``params`` is the kernel's single by-value struct argument."""
        args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        _check(_Lib.get().cuLaunchKernel(self.func, grid, 1, 1, self.threads, 1, 1, self.smem_bytes,
                                         ctypes.c_void_p(stream), args, None),
               f"cuLaunchKernel({self.name}, grid={grid})")


def load_module(cubin: Path, device: torch.device) -> ctypes.c_void_p:
    """The cubin loaded into the device's primary context (the one torch uses)."""
    torch.empty(1, device=device)  # torch makes its (primary) context current on this thread
    lib = _Lib.get()
    module = ctypes.c_void_p()
    data = cubin.read_bytes()
    _check(lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(data)), f"cuModuleLoadData({cubin.name})")
    return module


def get_function(module: ctypes.c_void_p, name: str) -> ctypes.c_void_p:
    func = ctypes.c_void_p()
    _check(_Lib.get().cuModuleGetFunction(ctypes.byref(func), module, name.encode()), f"cuModuleGetFunction({name})")
    return func
