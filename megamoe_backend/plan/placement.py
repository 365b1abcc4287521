"""Expert placement: which rank owns which physical expert, and in which local slot.

Physical experts are what the dispatch routes to. Without redundancy they are the model's
(logical) experts laid out linearly, E / ep_size per rank. With EPLB-style redundancy a logical
expert may have several physical replicas on different ranks; ``logical_of_physical`` says whose
weights each physical slot holds. The layer only ever sees physical ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PlacementError(ValueError):
    """An expert placement that cannot be served (uneven split, unknown rank, bad ids)."""


@dataclass(frozen=True)
class ExpertPlacement:
    ep_size: int
    owner: tuple[int, ...]  # physical expert -> owning rank
    slot: tuple[int, ...]  # physical expert -> local slot on that rank
    logical_of_physical: tuple[int, ...]  # physical expert -> logical expert (weights)

    @property
    def num_physical(self) -> int:
        return len(self.owner)

    @property
    def num_logical(self) -> int:
        return max(self.logical_of_physical) + 1 if self.logical_of_physical else 0

    def local_experts(self, rank: int) -> list[int]:
        """Physical ids owned by ``rank``, in local-slot order."""
        ids = [p for p, r in enumerate(self.owner) if r == rank]
        return sorted(ids, key=lambda p: self.slot[p])

    def num_local(self, rank: int) -> int:
        return sum(1 for r in self.owner if r == rank)

    def tables(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(owner, slot) as int64 lookup tensors indexed by physical expert id."""
        return (
            torch.tensor(self.owner, dtype=torch.int64, device=device),
            torch.tensor(self.slot, dtype=torch.int64, device=device),
        )

    @classmethod
    def linear(cls, num_experts: int, ep_size: int) -> "ExpertPlacement":
        if ep_size < 1:
            raise PlacementError(f"ep_size={ep_size} must be >= 1")
        if num_experts % ep_size:
            raise PlacementError(
                f"n_routed_experts={num_experts} is not divisible by the EP size {ep_size}; "
                "choose an EP size that divides the expert count (or add redundant experts)"
            )
        per = num_experts // ep_size
        return cls(
            ep_size=ep_size,
            owner=tuple(p // per for p in range(num_experts)),
            slot=tuple(p % per for p in range(num_experts)),
            logical_of_physical=tuple(range(num_experts)),
        )

    @classmethod
    def from_assignment(cls, owner: list[int], ep_size: int, logical_of_physical: list[int] | None = None) -> "ExpertPlacement":
        """Physical expert p lives on rank owner[p]; slots are given in increasing p per rank."""
        if any(not 0 <= r < ep_size for r in owner):
            raise PlacementError(f"expert owners must be ranks in 0..{ep_size - 1}, got {sorted(set(owner))}")
        logical = list(range(len(owner))) if logical_of_physical is None else list(logical_of_physical)
        if len(logical) != len(owner):
            raise PlacementError(f"logical_of_physical has {len(logical)} entries for {len(owner)} physical experts")
        missing = set(range(max(logical) + 1)) - set(logical)
        if missing:
            raise PlacementError(f"logical experts {sorted(missing)[:8]} have no physical replica")
        counters = [0] * ep_size
        slots = []
        for r in owner:
            slots.append(counters[r])
            counters[r] += 1
        return cls(ep_size=ep_size, owner=tuple(owner), slot=tuple(slots), logical_of_physical=tuple(logical))
