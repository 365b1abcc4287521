"""Where the EP ranks run: host, GPU and which GPUs each rank's process can write.

Why: ``MEGA_DISPATCH=auto`` on CUDA can only serve the capturable device P2P forward (``ipc`` /
``symm``) when every EP rank can write every other rank's arena: one host, CUDA peer access
between their GPUs. No single process knows that, so each rank describes its own place
(:func:`local_place`) and the EP group gathers the places once at start-up
(:func:`gather_ep_topology`, a collective). Selection (``select.py``) reads only the gathered
:class:`EpTopology`, a frozen fact that tests build by hand to check the whole table on CPU.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class RankPlace:
    """One EP rank's place.

    ``host`` is the host name plus the kernel's boot id (two machines that share a host name are
    still two hosts); ``gpu`` the GPU's UUID ("" on CPU); ``reachable`` the UUIDs of the GPUs this
    rank's process can write: its own and those with CUDA peer access (a GPU hidden by
    CUDA_VISIBLE_DEVICES is not reachable: CUDA IPC cannot map memory of a device it cannot see).
    """

    host: str
    gpu: str = ""
    reachable: tuple[str, ...] = ()
    symm_mem: bool = False  # this process's torch offers symmetric memory (torch.distributed._symmetric_memory)


@dataclass(frozen=True)
class EpTopology:
    """Every EP rank's place, in rank order (the same on every rank once gathered)."""

    ranks: tuple[RankPlace, ...]

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.host for r in self.ranks))

    @property
    def one_host(self) -> bool:
        return len(self.hosts) == 1

    @property
    def shares_gpu(self) -> bool:
        """Two ranks on one GPU (torch symmetric memory refuses that; CUDA IPC serves it)."""
        gpus = [r.gpu for r in self.ranks]
        return len(set(gpus)) < len(gpus)

    @property
    def symm_offered(self) -> bool:
        return all(r.symm_mem for r in self.ranks)

    def missing_peer_access(self) -> list[tuple[int, int]]:
        """(a, b): ep_rank a's process cannot write ep_rank b's GPU (same GPU always can)."""
        return [(a, b) for a, ra in enumerate(self.ranks) for b, rb in enumerate(self.ranks)
                if ra.gpu != rb.gpu and rb.gpu not in ra.reachable]

    def describe(self) -> str:
        gpus = len({r.gpu for r in self.ranks})
        return f"{len(self.ranks)} EP ranks on {len(self.hosts)} host(s), {gpus} GPU(s)"


def host_identity() -> str:
    try:
        with open(BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def symm_mem_offered() -> bool:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    return hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")


def _gpu_id(torch_module, index: int) -> str:
    props = torch_module.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid:
        return str(uuid)
    bus = getattr(props, "pci_bus_id", None)
    return f"pci:{getattr(props, 'pci_domain_id', 0)}:{bus}:{getattr(props, 'pci_device_id', 0)}" if bus is not None else f"index:{index}"


def local_place(device, torch_module=None) -> RankPlace:
    """This process's place; ``device`` is the rank's torch device (cuda:N or cpu)."""
    if torch_module is None:
        import torch as torch_module
    host = host_identity()
    if getattr(device, "type", str(device)) != "cuda":
        return RankPlace(host)
    cuda = torch_module.cuda
    index = device.index if device.index is not None else cuda.current_device()
    reachable = tuple(_gpu_id(torch_module, j) for j in range(cuda.device_count())
                      if j == index or cuda.can_device_access_peer(index, j))
    return RankPlace(host, _gpu_id(torch_module, index), reachable, symm_mem_offered())


def gather_ep_topology(group, device) -> EpTopology:
    """Collective over ``group`` (every EP rank calls it, at start-up): every rank's place."""
    import torch.distributed as dist

    places: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, local_place(device), group=group)
    return EpTopology(tuple(places))
