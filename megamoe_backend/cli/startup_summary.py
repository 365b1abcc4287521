"""Many layers' startup lines -> one line per distinct plan, for commands that build dozens.

Why: `megamoe demo` builds a layer per rank per case (20+ identical-but-for-ep_rank lines
before its table). The line stays the contract engines log (``LayerPlan.startup_line``); this only
folds them: the ``key=value`` fields every plan shares are printed once, then each distinct plan
(ranks folded) with only the fields that tell it apart -- as plain lines or as table rows.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "[megamoe] Created MegaMoE: "


def parse_startup_line(line: str) -> dict[str, str]:
    """``[megamoe] Created MegaMoE: k=v k=v ...`` -> {k: v} (in order); ValueError for any other line."""
    if not line.startswith(PREFIX):
        raise ValueError(f"not a MegaMoE startup line: {line!r}")
    fields = {}
    for item in line[len(PREFIX):].split():
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"startup line field {item!r} is not key=value")
        fields[key] = value
    return fields


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2] -> "0-2"; [0, 2] -> "0,2"."""
    ranks = sorted(set(ranks))
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


@dataclass(frozen=True)
class StartupSummary:
    """Startup lines folded: the fields all plans share, then one row per distinct plan."""

    line_count: int  # startup lines read (one per layer built)
    shared: dict[str, str]  # fields equal in every plan
    columns: tuple[str, ...]  # the fields that tell plans apart
    plans: tuple[tuple[str, tuple[str, ...]], ...]  # (ranks, values of ``columns``) per distinct plan

    def lines(self) -> list[str]:
        head = f"{self.line_count} startup lines, {len(self.plans)} distinct plans; shared: " + " ".join(
            f"{k}={v}" for k, v in self.shared.items())
        return [head] + [f"  ranks {ranks}: " + " ".join(f"{k}={v}" for k, v in zip(self.columns, values))
                         for ranks, values in self.plans]


def summarise_startup_lines(lines: list[str]) -> StartupSummary:
    """One row per distinct plan (lines equal but for ep_rank fold into one), after the shared fields."""
    plans: dict[tuple, list[int]] = {}
    for line in lines:
        fields = parse_startup_line(line)
        rank = int(fields.pop("ep_rank", "0"))
        plans.setdefault(tuple(fields.items()), []).append(rank)
    dicts = [dict(key) for key in plans]
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    shared = {k: dicts[0][k] for k in keys if all(d.get(k) == dicts[0][k] for d in dicts)} if dicts else {}
    columns = tuple(k for k in keys if k not in shared)
    rows = tuple((_ranks(ranks), tuple(d.get(k, "-") for k in columns)) for d, ranks in zip(dicts, plans.values()))
    return StartupSummary(len(lines), shared, columns, rows)


__all__ = ["StartupSummary", "parse_startup_line", "summarise_startup_lines"]
