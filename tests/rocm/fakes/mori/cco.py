"""Fake mori.cco: Communicator as published in mori/cco/communicator.py (1.2.4).

``Communicator.init`` leaves hipErrorNotSupported as the HIP last error, as mori's cco does where
fabric handles are unsupported (cleared in mori only since ROCm/mori#761; fakes/fake_hip.py).
"""

import fake_hip

from . import CALL_LOG

_STATE: dict = {}


class UniqueId:
    def __init__(self, token: bytes = b"fake-uid") -> None:
        self.token = token


class Communicator:
    DEFAULT_PER_RANK_VMM: int = 4 * 1024 * 1024 * 1024

    @staticmethod
    def get_unique_id() -> UniqueId:
        CALL_LOG.append(("cco.get_unique_id",))
        return UniqueId()

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id: UniqueId, per_rank_vmm: int = DEFAULT_PER_RANK_VMM) -> "Communicator":
        CALL_LOG.append(("cco.init", nranks, rank, per_rank_vmm))
        if not isinstance(unique_id, UniqueId):
            raise TypeError("fake cco: unique_id must be the UniqueId made on rank 0 and broadcast")
        comm = cls()
        comm._rank, comm._nranks, comm.per_rank_vmm = rank, nranks, per_rank_vmm
        fake_hip.LAST_ERROR["code"] = fake_hip.HIP_ERROR_NOT_SUPPORTED  # the hipMemCreate probe's leftover
        return comm

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def nranks(self) -> int:
        return self._nranks

    def barrier(self) -> None:
        CALL_LOG.append(("cco.barrier", self._rank))
