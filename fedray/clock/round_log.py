"""A round on the clock (:class:`ClockedRound`: its times, costs and clients), and what a run's clock remembers of its
rounds (:class:`RoundLog`): rounds.parquet's columns and the running totals of its rows, one number a round and column
(``array``'s 8-byte items, grown as rounds come), never a round's clients.

A round's clients are its stage's to keep for as long as the stage needs them: a clock that kept them (and an
object a round) held a million-client run's 16,418 rounds' worth of them, about 15 MB, to its end, where the driver's
memory peaks, only to count them.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from fedray.core.results import STALENESS_COUNTS, rounds_schema

_INTEGERS = ("round", "selected", "finished", "stragglers", "dropped")
_FLOATS = ("start_s", "end_s", "bytes_up", "bytes_down")
_TOTALS = ("compute_s", "comm_s", "stragglers", "dropped")


NOTHING_LOST = np.zeros(0, dtype=np.int64)
NOTHING_LOST.flags.writeable = False
"""The ``lost`` of every round that lost no upload (most of them): one array shared, read-only."""


@dataclass(frozen=True, slots=True)
class ClockedRound:
    """One round on the clock, as rounds.parquet holds it, and the clients that train in it."""

    number: int
    """The run's round number (a two-stage run's training rounds come after its closed form's)."""
    stage: str
    start_s: float
    end_s: float
    selected: np.ndarray
    """The clients the round asked, in the selector's order."""
    clients: np.ndarray
    """Those whose uploads the round keeps, in the selector's order: the only ones trained."""
    steps: np.ndarray | None
    """Each of ``clients``' local steps under ``--stragglers partial`` (None: every client all its steps)."""
    stragglers: int
    dropped: int
    bytes_up: float
    """The kept uploads' bytes."""
    bytes_down: float
    """Every selected client's download."""
    compute_s: float
    comm_s: float
    lost: np.ndarray = field(default_factory=lambda: NOTHING_LOST)
    """The selected clients whose uploads were lost (stragglers with nothing sent, dropouts), by id; not those that
    over-commitment cut."""
    staleness: np.ndarray | None = None
    """An asynchronous server step's updates by staleness: element s counts those s versions old (None: a
    synchronous round)."""


class RoundLog:
    """The rounds of a run's clock in order: their rows, and after each the running totals of the clock's columns
    (0 + the first + the second + ..., in the rounds' order: the same floats as summing the rounds afresh)."""

    def __init__(self) -> None:
        self._integers = {name: array("q") for name in _INTEGERS}
        self._floats = {name: array("d") for name in _FLOATS}
        self._stages: list[str] = []
        self._stale_at = array("q")
        """The positions of the asynchronous steps, increasing, and their staleness counts:"""
        self._stale_counts: list[np.ndarray] = []
        self._totals = {name: array("d" if name.endswith("_s") else "q") for name in _TOTALS}

    def __len__(self) -> int:
        return len(self._stages)

    def last(self) -> tuple[int, str] | None:
        """The last round's number and stage (None before any)."""
        return (self._integers["round"][-1], self._stages[-1]) if self._stages else None

    def append(self, record: ClockedRound) -> None:
        """``record``'s row, and the totals after it (its clients are not kept)."""
        row = {"round": record.number, "selected": len(record.selected), "finished": len(record.clients),
               "stragglers": record.stragglers, "dropped": record.dropped}
        for name in _INTEGERS:
            self._integers[name].append(row[name])
        for name in _FLOATS:
            self._floats[name].append(getattr(record, name))
        self._stages.append(record.stage)
        if record.staleness is not None:
            self._stale_at.append(len(self._stages) - 1)
            self._stale_counts.append(record.staleness)
        for name in _TOTALS:
            before = self._totals[name][-1] if self._totals[name] else 0
            self._totals[name].append(before + getattr(record, name))

    def done_by(self, number: int) -> int:
        """How many of the rounds are numbered ``number`` or less: O(log rounds)."""
        return bisect_right(self._integers["round"], number)

    def totals(self, done: int) -> dict[str, float | int]:
        """The clock's columns after the first ``done`` rounds (a row before any round: the clock's start)."""
        if not done:
            return {"clock_s": 0.0, "clock_compute_s": 0.0, "clock_comm_s": 0.0, "clients_straggled": 0,
                    "clients_dropped": 0}
        at = done - 1
        return {"clock_s": self._floats["end_s"][at], "clock_compute_s": self._totals["compute_s"][at],
                "clock_comm_s": self._totals["comm_s"][at], "clients_straggled": self._totals["stragglers"][at],
                "clients_dropped": self._totals["dropped"][at]}

    def aggregations(self, done: int) -> int:
        """The asynchronous server steps among the first ``done`` rounds: O(log rounds)."""
        return bisect_left(self._stale_at, done)

    def staleness(self, first: int, stop: int) -> Sequence[np.ndarray]:
        """The staleness counts of the asynchronous steps among rounds ``first`` .. ``stop`` - 1 (positions), in
        order: O(log rounds + the steps among them)."""
        return self._stale_counts[bisect_left(self._stale_at, first):bisect_left(self._stale_at, stop)]

    def table(self) -> pa.Table:
        """rounds.parquet: one row a round, in order (an asynchronous step's with its ``staleness_counts``)."""
        columns: dict[str, object] = {name: np.array(values, dtype=np.int64) for name, values in self._integers.items()}
        columns |= {name: np.array(values, dtype=np.float64) for name, values in self._floats.items()}
        columns["stage"] = self._stages
        asynchronous = bool(self._stale_counts)
        if asynchronous:
            counts: list[list[int] | None] = [None] * len(self)
            for position, count in zip(self._stale_at, self._stale_counts):
                counts[position] = count.tolist()
            columns[STALENESS_COUNTS] = counts
        schema = rounds_schema(asynchronous)
        return pa.table({name: columns[name] for name in schema.names}, schema=schema)
