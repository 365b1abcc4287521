"""One forward object per way of running the layer, picked once when the layer is built.

    DeviceForward  CUDA, Triton experts, ep_size 1: sync-free, on fixed buffers, capturable
    P2PForward     the same across ranks over peer arenas (ipc | symm | the one-process emulator)
    TorchForward   a Transport over torch.distributed (NCCL / gloo) or mori: eager, host checks
    FusedForward   aiter's fused MegaMoE runtime (ROCm): dispatch, both GEMMs and combine in one

Why objects, not branches: each path owns different state (a workspace, a transport, a fused
runtime) and different checks; MegaMoELayer composes one of them with the plan and the weights, as
vLLM's modular kernel composes prepare/finalize with experts.
"""

from .base import LayerForward
from .device import DeviceForward
from .fused import FusedForward
from .p2p import P2PForward
from .torch_path import TorchForward

__all__ = ["DeviceForward", "FusedForward", "LayerForward", "P2PForward", "TorchForward"]
