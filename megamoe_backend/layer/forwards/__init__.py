"""One forward object per way of running the layer, picked once when the layer is built.

    DeviceForward  CUDA, Triton experts, ep_size 1: sync-free, on fixed buffers, capturable
    P2PForward     the same across ranks over peer arenas (ipc | symm | the one-process emulator)
    MoriForward    the same across ranks over mori (ROCm): mori's counts stay on the device
    TorchForward   a Transport over torch.distributed (NCCL / gloo) or mori: eager, host checks
    FusedForward   aiter's fused MegaMoE runtime (ROCm): dispatch, both GEMMs and combine in one,
                   sync-free (counts on the device, the runtime per step from the token bound)

Why objects, not branches: each path owns different state (a workspace, a transport, a fused
runtime) and different checks; MegaMoELayer composes one of them with the plan and the weights, as
vLLM's modular kernel composes prepare/finalize with experts.
"""

from .base import LayerForward
from .device import DeviceForward
from .fused import FusedForward
from .mori import MoriForward
from .p2p import P2PForward
from .torch_path import TorchForward

__all__ = ["DeviceForward", "FusedForward", "LayerForward", "MoriForward", "P2PForward", "TorchForward"]
