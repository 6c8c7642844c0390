"""What a run's clock remembers of its rounds: rounds.parquet's columns and the running totals of its rows, one
number a round and column (``array``'s 8-byte items, grown as rounds come), never a round's clients.

A round's clients are its stage's to keep for as long as the stage needs them: a clock that kept them (and an
object a round) held a million-client run's 16,418 rounds' worth of them, about 15 MB, to its end, where the driver's
memory peaks, only to count them.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from fedray.core.results import STALENESS_COUNTS, rounds_schema

_INTEGERS = ("round", "selected", "finished", "stragglers", "dropped")
_FLOATS = ("start_s", "end_s", "bytes_up", "bytes_down")
_TOTALS = ("compute_s", "comm_s", "stragglers", "dropped", "aggregations")


@dataclass(frozen=True)
class LoggedRound:
    """One round as the log takes it: rounds.parquet's row, and its compute and communication seconds."""

    number: int
    stage: str
    start_s: float
    end_s: float
    selected: int
    finished: int
    stragglers: int
    dropped: int
    bytes_up: float
    bytes_down: float
    compute_s: float
    comm_s: float
    staleness: np.ndarray | None = None
    """An asynchronous server step's updates by staleness (None: a synchronous round)."""


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

    def append(self, logged: LoggedRound) -> None:
        for name in _INTEGERS:
            self._integers[name].append(getattr(logged, "number" if name == "round" else name))
        for name in _FLOATS:
            self._floats[name].append(getattr(logged, name))
        self._stages.append(logged.stage)
        if logged.staleness is not None:
            self._stale_at.append(len(self._stages) - 1)
            self._stale_counts.append(logged.staleness)
        for name in _TOTALS:
            before = self._totals[name][-1] if self._totals[name] else 0
            added = logged.staleness is not None if name == "aggregations" else getattr(logged, name)
            self._totals[name].append(before + added)

    def done_by(self, number: int) -> int:
        """How many of the rounds are numbered ``number`` or less: O(log rounds)."""
        return bisect_right(self._integers["round"], number)

    def totals(self, done: int) -> dict[str, float | int]:
        """The clock's columns after the first ``done`` rounds (a row before any round: the clock's start)."""
        if not done:
            return {"clock_s": 0.0, "clock_compute_s": 0.0, "clock_comm_s": 0.0, "clients_straggled": 0,
                    "clients_dropped": 0, "aggregations": 0}
        at = done - 1
        return {"clock_s": self._floats["end_s"][at], "clock_compute_s": self._totals["compute_s"][at],
                "clock_comm_s": self._totals["comm_s"][at], "clients_straggled": self._totals["stragglers"][at],
                "clients_dropped": self._totals["dropped"][at], "aggregations": self._totals["aggregations"][at]}

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
