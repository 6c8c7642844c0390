"""A schedule of rounds as a lazy, immutable sequence: the clients of round r are made when round r is read.

A run's schedule has rounds × κ clients (15 million at a million clients, κ =
100, sampled with replacement until every client was seen), far more than the
driver needs at once. :class:`Schedule` reads them from a source that draws
them in blocks (:class:`Blocks`: a seeded permutation, a chunk of rounds)
regenerated from the generator's state at the block's start, so it holds the
recorded states and one block, never every round.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Protocol, overload

import numpy as np


class Source(Protocol):
    """Where a schedule reads its rounds: round ``i``'s clients for any ``i`` the schedule's indices name."""

    def __getitem__(self, index: int) -> np.ndarray: ...


class Blocks:
    """Blocks drawn one after another from one generator, ``draw(rng)`` each: block b is drawn again from the
    generator's state at its start, recorded when the blocks before it were first drawn; only the last block read is
    kept (read-only)."""

    def __init__(self, rng: np.random.Generator, draw: Callable[[np.random.Generator], np.ndarray]) -> None:
        self._rng = np.random.Generator(type(rng.bit_generator)())
        self._draw = draw
        self._starts = [rng.bit_generator.state]
        self._kept: tuple[int, np.ndarray] | None = None

    def __getitem__(self, block: int) -> np.ndarray:
        if self._kept is None or self._kept[0] != block:
            for earlier in range(len(self._starts) - 1, block):  # the states up to block's start, drawn once in order
                self._drawn(earlier)
            self._kept = (block, self._drawn(block))
        return self._kept[1]

    def _drawn(self, block: int) -> np.ndarray:
        self._rng.bit_generator.state = self._starts[block]
        drawn = self._draw(self._rng)
        drawn.flags.writeable = False
        if block + 1 == len(self._starts):
            self._starts.append(self._rng.bit_generator.state)
        return drawn


class Packed:
    """Rounds kept in one array, the narrowest integer type that holds their client ids (int32 below 2³¹ clients),
    with their offsets: what a stage keeps of rounds made once (the clock's), about half the memory of an int64
    array a round. A round reads as a fresh int64 array."""

    def __init__(self, rounds: Sequence[np.ndarray]) -> None:
        largest = max((int(clients.max()) for clients in rounds if len(clients)), default=0)
        self._clients = np.concatenate([np.zeros(0, np.int64), *rounds]).astype(np.min_scalar_type(-1 - largest))
        self._offsets = np.concatenate(([0], np.cumsum([len(clients) for clients in rounds], dtype=np.int64)))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self._clients[self._offsets[index]:self._offsets[index + 1]].astype(np.int64)


class Joined:
    """Schedules one after another."""

    def __init__(self, parts: Sequence[Schedule]) -> None:
        self._parts = tuple(parts)
        self._ends = list(accumulate(len(part) for part in self._parts))

    def __getitem__(self, index: int) -> np.ndarray:
        part = bisect_right(self._ends, index)
        return self._parts[part][index - (self._ends[part - 1] if part else 0)]


class Schedule(Sequence[np.ndarray]):
    """The clients of each round, ``source[i]`` for each ``i`` of ``indices``: indexed, sliced (a schedule again),
    iterated and joined (``+``) without making the rounds it does not read."""

    def __init__(self, source: Source, indices: range) -> None:
        self._source, self._indices = source, indices

    @classmethod
    def of(cls, rounds: Sequence[np.ndarray] = ()) -> Schedule:
        """A schedule of the given rounds (none by default)."""
        rounds = tuple(rounds)
        return cls(rounds, range(len(rounds)))

    @classmethod
    def packed(cls, rounds: Sequence[np.ndarray]) -> Schedule:
        """A schedule of the given rounds (arrays of client ids ≥ 0), kept :class:`Packed`."""
        source = Packed(rounds)
        return cls(source, range(len(source)))

    def __len__(self) -> int:
        return len(self._indices)

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> Schedule: ...

    def __getitem__(self, index: int | slice) -> np.ndarray | Schedule:
        if isinstance(index, slice):
            return Schedule(self._source, self._indices[index])
        return self._source[self._indices[index]]

    def __add__(self, other: Sequence[np.ndarray]) -> Schedule:
        other = other if isinstance(other, Schedule) else Schedule.of(other)
        return Schedule(Joined((self, other)), range(len(self) + len(other)))

    def __eq__(self, other: object) -> bool:
        """Equal, as values, to a sequence of the same rounds (another schedule, a list of arrays): the same number of
        rounds, each of the same clients in the same order. Reads every round of both."""
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(np.array_equal(mine, theirs) for mine, theirs in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # equal by value, and a view of rounds drawn on demand

    def __repr__(self) -> str:
        return f"Schedule({len(self)} rounds)"
