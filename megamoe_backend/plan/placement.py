"""Expert placement: which rank owns which physical expert, and in which local slot.

Physical experts are what the dispatch routes to. Without redundancy they are the model's
(logical) experts laid out linearly, E / ep_size per rank. With EPLB-style redundancy a logical
expert may have several physical replicas on different ranks; ``logical_of_physical`` says whose
weights each physical slot holds. The layer only ever sees physical ids.

EPLB in vLLM and SGLang keeps physical experts contiguous (physical p on rank p // (P / ep) in slot
p % (P / ep)) and rebalances by changing which logical expert a physical slot holds, never where the
slot lives: :meth:`ExpertPlacement.contiguous` builds that placement from the engine's map.
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

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    def redundant_per_rank(self) -> tuple[int, ...]:
        """Per rank, the local slots holding a second (third, ...) replica of a logical expert:
        the first replica in physical-id order counts as the expert, every later one as redundant."""
        seen: set[int] = set()
        counts = [0] * self.ep_size
        for p, logical in enumerate(self.logical_of_physical):
            if logical in seen:
                counts[self.owner[p]] += 1
            seen.add(logical)
        return tuple(counts)

    def describe(self) -> str:
        """``experts=P logical=L redundant/rank=...`` for the startup line and ``megamoe info``."""
        per_rank = self.redundant_per_rank()
        redundant = ",".join(map(str, per_rank)) if any(per_rank) else "0"
        return f"experts={self.num_physical} logical={self.num_logical} redundant/rank={redundant}"

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
    def contiguous(
        cls, physical_to_logical: list[int], ep_size: int, num_logical: int | None = None,
        map_name: str = "physical_to_logical",
    ) -> "ExpertPlacement":
        """An engine's EPLB map as a placement: physical p on rank p // (P / ep_size), slot p % (P / ep_size).

        ``num_logical`` (the model's routed experts) lets a missing last expert be caught too;
        ``map_name`` names the engine's map in every error.
        """
        logical = [int(x) for x in physical_to_logical]
        if ep_size < 1 or not logical or len(logical) % ep_size:
            raise PlacementError(
                f"{map_name} has {len(logical)} physical experts, which do not split over {ep_size} EP ranks; "
                "the physical expert count (routed + redundant experts) must be a multiple of the EP size"
            )
        _check_logical(logical, num_logical, map_name)
        per = len(logical) // ep_size
        return cls(
            ep_size=ep_size,
            owner=tuple(p // per for p in range(len(logical))),
            slot=tuple(p % per for p in range(len(logical))),
            logical_of_physical=tuple(logical),
        )

    @classmethod
    def from_assignment(cls, owner: list[int], ep_size: int, logical_of_physical: list[int] | None = None) -> "ExpertPlacement":
        """Physical expert p lives on rank owner[p]; slots are given in increasing p per rank."""
        if any(not 0 <= r < ep_size for r in owner):
            raise PlacementError(f"expert owners must be ranks in 0..{ep_size - 1}, got {sorted(set(owner))}")
        logical = list(range(len(owner))) if logical_of_physical is None else list(logical_of_physical)
        if len(logical) != len(owner):
            raise PlacementError(f"logical_of_physical has {len(logical)} entries for {len(owner)} physical experts")
        _check_logical(logical, None, "logical_of_physical")
        counters = [0] * ep_size
        slots = []
        for r in owner:
            slots.append(counters[r])
            counters[r] += 1
        return cls(ep_size=ep_size, owner=tuple(owner), slot=tuple(slots), logical_of_physical=tuple(logical))


def initial_redundant_map(num_logical: int, num_redundant: int) -> list[int]:
    """The physical -> logical map both engines start EPLB from: the routed experts in order, then
    redundant replicas of logical 0, 1, ... (vLLM ``EplbState.build_initial_global_physical_to_logical_map``,
    SGLang ``ExpertLocationMetadata.init_trivial``: physical p holds logical p % num_logical)."""
    if num_logical < 1 or num_redundant < 0:
        raise PlacementError(f"num_logical={num_logical} must be >= 1 and num_redundant={num_redundant} >= 0")
    return [p % num_logical for p in range(num_logical + num_redundant)]


def _check_logical(logical: list[int], num_logical: int | None, map_name: str) -> None:
    """Every entry a logical id in range, and every logical expert with at least one replica."""
    if not logical:
        raise PlacementError(f"{map_name} is empty")
    n = max(logical) + 1 if num_logical is None else num_logical
    bad = sorted({x for x in logical if not 0 <= x < n})
    if bad:
        raise PlacementError(f"{map_name} holds logical ids {bad[:8]} outside 0..{n - 1}")
    missing = sorted(set(range(n)) - set(logical))
    if missing:
        raise PlacementError(f"{map_name}: logical experts {missing[:8]} have no physical replica")
