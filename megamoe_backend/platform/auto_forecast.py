"""What ``MEGA_DISPATCH=auto`` will pick on CUDA, before the EP group exists (``megamoe info``).

Why a forecast and not a placeholder: auto's answer on CUDA depends on one fact that only the EP
group knows at start-up -- whether every EP rank can write every other rank's GPU (one host, CUDA peer
access). ``select.cuda_auto_transport`` decides from the gathered topology; before it exists the
selection carries a pending answer. ``megamoe info`` must not print that pending value as if it were
the decision, so this module asks the same function for each value the fact can take (one host with
peer access, ranks sharing a GPU, several hosts) and, where this machine has the GPUs, for this host's
own topology, and says which answer goes with which fact.
"""

from __future__ import annotations

from dataclasses import dataclass

from .select import PENDING_EP_GROUP, cuda_auto_transport
from .topology import EpTopology, RankPlace


@dataclass(frozen=True)
class AutoForecast:
    """auto's answer per fact it depends on; ``here``: its answer for this host's GPUs (None: not known here)."""

    one_host: str  # every EP rank on one host, its own GPU, peer access between all
    shared_gpu: str  # one host, peer access, some ranks share a GPU
    several_hosts: str  # ranks on more than one host (or without peer access)
    depends_on: str
    here: str | None = None
    here_why: str | None = None

    def describe(self) -> str:
        """One line for ``megamoe info``'s transport row."""
        line = (f"auto -> {self.one_host} when every EP rank is on one host with CUDA peer access "
                f"({self.shared_gpu} if ranks share a GPU), else {self.several_hosts} (eager: CUDA graphs off)")
        if self.here is not None:
            line += f"; on this host: {self.here} ({self.here_why})"
        return line


def _one_host(ep_size: int, symm: bool, shared: bool = False) -> EpTopology:
    gpus = [f"gpu{(r // 2) if shared else r}" for r in range(ep_size)]
    return EpTopology(tuple(RankPlace("host", g, tuple(gpus), symm) for g in gpus))


def _two_hosts(ep_size: int, symm: bool) -> EpTopology:
    return EpTopology(tuple(RankPlace(f"host{r % 2}", f"gpu{r}", (f"gpu{r}",), symm) for r in range(ep_size)))


def cuda_auto_forecast(provider: str, ep_size: int, symm_offered: bool,
                       this_host: EpTopology | None = None) -> AutoForecast | None:
    """auto's answers for ``ep_size`` ranks of ``provider`` experts; None when auto does not wait for the
    EP group (ep_size 1, no Triton: its answer is already final). ``symm_offered``: this torch has
    symmetric memory (``topology.symm_mem_offered``); ``this_host``: the topology of ``ep_size`` ranks on
    this machine's GPUs (``local_topology``), when it has that many."""
    if cuda_auto_transport(provider, ep_size, None)[0] != PENDING_EP_GROUP:
        return None
    one, _ = cuda_auto_transport(provider, ep_size, _one_host(ep_size, symm_offered))
    shared, _ = cuda_auto_transport(provider, ep_size, _one_host(ep_size, symm_offered, shared=True))
    several, _ = cuda_auto_transport(provider, ep_size, _two_hosts(ep_size, symm_offered))
    symm_note = "torch here offers symmetric memory" if symm_offered else "torch here has no symmetric memory"
    depends = (f"decided at start-up over the EP group: whether every EP rank can write every other rank's GPU "
               f"(one host, CUDA peer access; {symm_note})")
    here = here_why = None
    if this_host is not None:
        here, here_why = cuda_auto_transport(provider, ep_size, this_host)
    return AutoForecast(one, shared, several, depends, here, here_why)


def local_topology(ep_size: int, torch_module=None) -> EpTopology | None:
    """The topology of ``ep_size`` rank processes on this machine's first ``ep_size`` GPUs, one each
    (what a serving engine on this host starts), or None without that many CUDA GPUs."""
    if torch_module is None:
        import torch as torch_module
    cuda = torch_module.cuda
    if getattr(torch_module.version, "hip", None) or not cuda.is_available() or cuda.device_count() < ep_size:
        return None
    from .topology import local_place

    return EpTopology(tuple(local_place(torch_module.device("cuda", i), torch_module) for i in range(ep_size)))


__all__ = ["AutoForecast", "cuda_auto_forecast", "local_topology"]
