"""What a closed-form method keeps in a shard for its second pass (FedCOF's received means), within a memory budget.

A method whose solve needs a second look at what clients sent (``ClosedFormMethod.kept_in_shards``) leaves that
part in the shard that computed it, tagged by the run, the block of rounds it came in and its leaf of clients. Parts
beyond the shard's budget are not kept: the second pass computes them again from the clients' rows, in the same runs of
clients and so to the same bits (as it does after Ray restarted a shard, which lost them).
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from fedray.methods.base import floats_in

KEPT_SHARE = 8
"""The shards filling a machine keep at most 1/KEPT_SHARE of its memory of parts between them (the rest is computed
again when needed)."""


def default_budget(cpus: float | None = None) -> int:
    """Bytes of kept parts a shard holds: :data:`KEPT_SHARE`'s share of this machine's memory; with ``cpus``, that
    share split among the actors of ``cpus`` CPUs each that fill the machine (the clients' states' budget)."""
    share = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // KEPT_SHARE
    return share if cpus is None or cpus <= 0 else int(share * min(1.0, cpus / (os.cpu_count() or 1)))


@dataclass
class KeptParts:
    """Kept parts by run token and tag (block, leaf): a list per tag (one per run of clients), or None where not
    kept."""

    budget: int = field(default_factory=default_budget)
    used: int = 0
    runs: dict[str, dict[Hashable, list[Any] | None]] = field(default_factory=dict)

    def add(self, token: str, tag: Hashable, parts: list[Any], must_keep: bool = False) -> None:
        """Keep ``parts`` if they fit the budget (or ``must_keep``: they cannot be computed again)."""
        size = 8 * floats_in(parts)
        held = must_keep or self.used + size <= self.budget
        self.used += size if held else 0
        self.runs.setdefault(token, {})[tag] = parts if held else None

    def fits(self, size: int) -> bool:
        """Whether ``size`` more bytes of parts fit the budget."""
        return self.used + size <= self.budget

    def parts(self, token: str, tag: Hashable) -> list[Any] | None:
        """The parts of ``tag``, None where they were not kept (over the budget, or lost with a restart)."""
        return self.runs.get(token, {}).get(tag)

    def forget(self, token: str) -> None:
        """Drop a finished run's parts."""
        for parts in self.runs.pop(token, {}).values():
            self.used -= 8 * floats_in(parts) if parts is not None else 0
