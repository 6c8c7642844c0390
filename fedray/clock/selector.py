"""Client selection as a plugin: which clients a synchronous round asks to train, from those online at its start.

A :class:`Selector` is a frozen dataclass whose fields with defaults are its
options (``fedray.Selector``; a researcher's own is one file, see
``examples/oort_selector.py``). The engine's event loop calls
:meth:`Selector.select` once a round, in round order, with the round's
:class:`RoundContext`: its number and start (known only once the previous round
has ended), κ and how many clients to ask (⌈o·κ⌉ under over-commitment, which
the round scheduler then cuts back to κ), the run's schedule row for the round
(today's draw), who is online, the clients' expected durations and what the
server has seen of them (:class:`ClientHistory`).

The built-ins, and the rule that keeps a clock that changes nothing bitwise the run of today:

* ``uniform`` keeps the round's scheduled clients that are online at its
  start, in their order, and fills up to the number asked with clients drawn
  from the round's own stream (stream 45: a counter-based hash of the run's seed,
  the round and a draw counter) among the round's candidates not yet picked: the
  online clients, and in a closed form's round only those it still has to hear
  (:attr:`RoundContext.eligible`). With
  everyone online and nothing more asked, it returns the schedule row: today's
  rounds bit for bit. The scheduled row is a uniform κ-subset of the clients
  (a row drawn with replacement, or a slice of a uniform permutation), and the
  fill draws uniformly among the remaining online clients, so the whole
  procedure is unchanged by any permutation of the online clients: the round is
  a uniform subset of the clients online at its start. Without replacement, a
  client offline at its turn misses that pass, and a fill may be a client of
  another round of the same pass.
* ``poisson`` keeps the round's scheduled clients (each client in with
  probability q = κ/K, independently) that are online: each online client is in
  independently with the same q, the rate the privacy analyses count with.
  Nothing is filled and over-commitment does not apply (the round's size is
  random by design).

The cost is O(κ) a round while the candidates are a fair share of the
population (expected K/|candidates| draws a pick); when the draws run past
:data:`FILL_BUDGET` per pick, one pass finishes the round uniformly instead,
so a round with fewer candidates than asked takes all of them: a pass over
every client (O(K) lookups), or where the round has an eligible set a pass
over its online clients (:attr:`RoundContext.eligible_online`), which is
also where a draw starts while the last pass found fewer than K /
:data:`FILL_BUDGET` of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from fedray.clock.lookups import AvailabilityLookup
from fedray.clock.streams import uniforms
from fedray.core.errors import FedrayError

FILL_STREAM = 45
"""The stream of a round's uniform draws of clients (the candidates a fill tries, in order)."""
ORDER_STREAM = 46
"""The stream ordering the eligible clients when a fill falls back to one pass over every client."""
FILL_BUDGET = 16
"""Draws a fill tries per client it still needs (plus :data:`FILL_FLOOR`) before the pass over every client."""
FILL_FLOOR = 1024
FILL_AHEAD = 4
"""Draws per client a fill needs that it first looks at all at once (:meth:`RoundContext._drawn_at_once`)."""

Eligible = Callable[[np.ndarray], np.ndarray]
"""Which of the given clients a draw may pick: a bool array."""


class ClientHistory:
    """What the server has seen of each client: arrays over the K clients, made once (O(K)), updated O(κ) a round.

    ``kept`` False: the run's selector reads none of it (:attr:`Selector.reads_history`), so none is kept (24 bytes a
    client: 24 MB at 10⁶), recording does nothing, and reading it is refused in one line.
    """

    def __init__(self, num_clients: int, kept: bool = True) -> None:
        self.kept = kept
        size = num_clients if kept else 0
        self._rounds = np.zeros(size, dtype=np.int64)
        self._last_round = np.full(size, -1, dtype=np.int64)
        self._duration_s = np.full(size, np.nan)
        self._utility: np.ndarray | None = None

    @property
    def rounds(self) -> np.ndarray:
        """Rounds whose upload from the client arrived."""
        return self._read(self._rounds)

    @property
    def last_round(self) -> np.ndarray:
        """The last such round (-1: none)."""
        return self._read(self._last_round)

    @property
    def duration_s(self) -> np.ndarray:
        """The client's duration in its last such round, from the round's start to its upload (NaN: unknown)."""
        return self._read(self._duration_s)

    @property
    def utility(self) -> np.ndarray:
        """Each client's statistical utility in its last round that measured one (NaN: none): Oort's
        |B|·sqrt(mean loss²), B its training samples, each sample's loss at the model the round sent (:meth:`measured`).
        A run measures it only for a selector that reads it (:attr:`Selector.uses_utility`); the array is made when
        first read or written (8 bytes a client that other runs do not hold)."""
        if self._utility is None:
            self._utility = np.full(len(self.rounds), np.nan)
        return self._utility

    def _read(self, array: np.ndarray) -> np.ndarray:
        if not self.kept:
            raise FedrayError("this run's selector declares reads_history = False, so the clock keeps no client "
                              "history: set reads_history = True on the selector to read it")
        return array

    def record(self, clients: np.ndarray, round: int, duration_s: np.ndarray,
               utility: np.ndarray | None = None) -> None:
        """The uploads of ``clients`` arrived in ``round``, ``duration_s`` after its start; ``utility``: their
        statistical utility."""
        if not self.kept:
            return
        self._rounds[clients] += 1
        self._last_round[clients] = round
        self._duration_s[clients] = duration_s
        if utility is not None:
            self.utility[clients] = utility

    def measured(self, clients: np.ndarray, samples: np.ndarray, loss_squares: np.ndarray) -> None:
        """The losses of ``clients``' last round: each one's ``samples`` |B| and the sum of their squared losses,
        giving its statistical utility |B| · sqrt(Σ loss² / |B|)."""
        samples = np.asarray(samples, dtype=np.float64)
        self.utility[clients] = samples * np.sqrt(np.asarray(loss_squares, dtype=np.float64) / samples)


@dataclass(frozen=True)
class RoundContext:
    """What a selector knows when a round starts.

    ``scheduled`` is the run's schedule row for the round (today's draw: κ
    distinct clients, fewer in a pass's last round, or a Poisson round);
    ``wanted`` how many clients to ask: ⌈o·m⌉ for a scheduled row of m (m with no
    over-commitment). ``availability`` None: every client is always online.
    ``expected_s``: the clients' expected duration for the round's task on their
    devices, where a device model is set. ``eligible``: a mask over the K
    clients of those the round may draw beyond its scheduled row (a closed
    form's: the clients it still has to hear, see
    :class:`~fedray.clock.hearing.StillToHear`); None: every client.
    ``eligible_online``: those of them online at the round's start, by id, for
    a draw that passes over them (None: a pass over the mask), and
    ``eligible_found`` how many such clients the last pass found (None: none
    yet), so that a draw goes straight to the pass while they are too few for
    random draws to find them.
    """

    round: int
    start_s: float
    per_round: int
    wanted: int
    num_clients: int
    seed: int
    scheduled: np.ndarray
    history: ClientHistory
    availability: AvailabilityLookup | None = None
    expected_s: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)
    eligible: np.ndarray | None = field(default=None, repr=False)
    eligible_online: Callable[[], np.ndarray] | None = field(default=None, repr=False)
    eligible_found: int | None = None

    def online(self, clients: np.ndarray) -> np.ndarray:
        """Whether each of ``clients`` is online at the round's start."""
        if self.availability is None or not len(clients):
            return np.ones(len(clients), dtype=bool)
        return np.asarray(self.availability.available(clients, self.start_s), dtype=bool)

    def candidates(self, clients: np.ndarray) -> np.ndarray:
        """Whether each of ``clients`` is a candidate of the round: online at its start and :attr:`eligible`."""
        online = self.online(clients)
        return online if self.eligible is None else online & self.eligible[clients]

    def draw_online(self, count: int, taken: np.ndarray | None = None, eligible: Eligible | None = None) -> np.ndarray:
        """Up to ``count`` distinct clients, in the order drawn, uniform among the round's candidates (online at its
        start and :attr:`eligible`), not in ``taken`` (none, if None) and ``eligible`` (all, if None): fewer only when
        fewer are such (see the module's note)."""
        taken = np.empty(0, dtype=np.int64) if taken is None else taken
        scarce = self.eligible_found is not None and self.eligible_found * FILL_BUDGET < self.num_clients
        budget = 0 if scarce else FILL_BUDGET * count + FILL_FLOOR
        picked = self._drawn_at_once(count, taken, eligible, budget)
        if picked is None:
            picked = self._drawn_in_batches(count, taken, eligible, budget)
        if len(picked) < count:
            rest = self._pass()
            taken = np.concatenate((taken, picked))
            if self.eligible_online is None:
                rest = rest[self._pickable(rest, taken, eligible)]
            else:  # the round's online eligible clients already: only those taken, or not ``eligible``, are left out
                pickable = _not_among(rest, taken)
                rest = rest[pickable & np.asarray(eligible(rest), dtype=bool) if eligible is not None else pickable]
            picked = np.concatenate((picked, rest[_first_in_order(uniforms(self.seed, ORDER_STREAM, rest, self.round),
                                                                  count - len(picked))]))
        return picked

    def _drawn_in_batches(self, count: int, taken: np.ndarray, eligible: Eligible | None,
                          budget: int) -> np.ndarray:
        """Up to ``count`` distinct candidates not ``taken``, in the order drawn, from batches of draws while fewer are
        found and fewer than ``budget`` were drawn (the draws a pass over every client then follows)."""
        picked = np.empty(0, dtype=np.int64)
        drawn = 0
        while len(picked) < count and drawn < budget:
            size = max(2 * (count - len(picked)), 64)
            candidates = self._draws(drawn, drawn + size)
            drawn += size
            candidates = candidates[self._pickable(candidates, np.concatenate((taken, picked)), eligible)]
            _, first = np.unique(candidates, return_index=True)
            picked = np.concatenate((picked, candidates[np.sort(first)][: count - len(picked)]))
        return picked

    def _drawn_at_once(self, count: int, taken: np.ndarray, eligible: Eligible | None,
                       budget: int) -> np.ndarray | None:
        """:meth:`_drawn_in_batches`' clients where the first ``count`` distinct candidates are among the first
        ``budget`` draws, found looking at a prefix of the draws at once (a few, then the whole budget): the batches
        would have found the same clients, stopping once they had; None where they are not (the batches decide which
        draws the pass follows)."""
        if not count or not budget:
            return None if count else np.empty(0, dtype=np.int64)
        for length in sorted({min(FILL_AHEAD * count + 64, budget), budget}):
            draws = self._draws(0, length)
            positions = np.flatnonzero(self._pickable(draws, taken, eligible))
            _, first = np.unique(draws[positions], return_index=True)
            if len(first) >= count:
                return draws[positions[np.sort(first)[:count]]]
        return None

    def _draws(self, start: int, stop: int) -> np.ndarray:
        """The round's fill draws ``start`` .. ``stop`` − 1: clients, uniform on the federation, any may repeat."""
        return np.floor(uniforms(self.seed, FILL_STREAM, np.arange(start, stop), self.round)
                        * self.num_clients).astype(np.int64)

    def _pass(self) -> np.ndarray:
        """The clients a pass looks at: every client, the eligible ones, or those of them online."""
        if self.eligible_online is not None:
            return self.eligible_online()
        return np.arange(self.num_clients, dtype=np.int64) if self.eligible is None else np.flatnonzero(self.eligible)

    def _pickable(self, clients: np.ndarray, taken: np.ndarray, eligible: Eligible | None) -> np.ndarray:
        pickable = self.candidates(clients) & ~np.isin(clients, taken) if len(taken) else self.candidates(clients)
        return pickable & np.asarray(eligible(clients), dtype=bool) if eligible is not None else pickable


def _not_among(clients: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """Whether each of ``clients`` (increasing, distinct) is not in ``taken``: ``~np.isin`` by binary search, O(taken ·
    log clients) rather than a pass over ``clients`` for each client taken."""
    pickable = np.ones(len(clients), dtype=bool)
    if len(taken) and len(clients):
        positions = np.minimum(np.searchsorted(clients, taken), len(clients) - 1)
        pickable[positions[clients[positions] == taken]] = False
    return pickable


def _first_in_order(keys: np.ndarray, count: int) -> np.ndarray:
    """The positions of the ``count`` smallest ``keys``, in increasing order of key, ties by position: the first
    ``count`` of a stable argsort, through a partition when they are few (O(n) rather than O(n log n))."""
    if count >= len(keys):
        return np.argsort(keys, kind="stable")
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    largest = np.partition(keys, count - 1)[count - 1]
    among = np.flatnonzero(keys <= largest)  # increasing positions: a stable sort of them keeps ties by position
    return among[np.argsort(keys[among], kind="stable")][:count]


@dataclass(frozen=True)
class Selector(ABC):
    """Picks a round's clients (``fedray.Selector``): subclass it as a frozen dataclass whose fields with defaults are
    its options, and define :meth:`select`. One that reads :attr:`ClientHistory.utility` says so with
    ``uses_utility = True``: the run then measures the clients' losses, and clocks training's rounds one at a time,
    each once the rounds before it have trained. One that reads no history at all may say so with
    ``reads_history = False`` (the built-ins do): the run then keeps none."""

    uses_utility: ClassVar[bool] = False
    """Whether :meth:`select` reads the clients' statistical utility (the run measures it only then)."""
    reads_history: ClassVar[bool] = True
    """Whether :meth:`select` reads :attr:`RoundContext.history` (the run keeps it only then, or for ``uses_utility``)."""

    @abstractmethod
    def select(self, context: RoundContext) -> np.ndarray:
        """The clients the round asks to train (distinct, int64, online at its start), in the order chosen."""


@dataclass(frozen=True)
class UniformSelector(Selector):
    """``uniform``: the schedule's clients online at the round's start, filled uniformly from the online ones."""

    reads_history: ClassVar[bool] = False

    def select(self, context: RoundContext) -> np.ndarray:
        kept = context.scheduled[context.online(context.scheduled)][: context.wanted]
        if len(kept) == context.wanted:
            return kept
        return np.concatenate((kept, context.draw_online(context.wanted - len(kept), kept)))


@dataclass(frozen=True)
class PoissonSelector(Selector):
    """``poisson``: the round's Poisson-sampled clients that are online at its start."""

    reads_history: ClassVar[bool] = False

    def select(self, context: RoundContext) -> np.ndarray:
        return context.scheduled[context.online(context.scheduled)]


SELECTORS: dict[str, type[Selector]] = {"uniform": UniformSelector, "poisson": PoissonSelector}


def check_selection(context: RoundContext, clients: np.ndarray, name: str) -> np.ndarray:
    """A selector's answer as int64, or a one-line error naming ``name`` when it is not distinct clients of the
    federation online at the round's start."""
    clients = np.asarray(clients)
    if clients.ndim != 1 or not (clients.dtype.kind in "iu" or len(clients) == 0):
        raise FedrayError(f"selector {name} must return a 1-d array of client ids, got {clients.dtype} of shape "
                          f"{clients.shape}")
    clients = clients.astype(np.int64)
    if len(clients) and (clients.min() < 0 or clients.max() >= context.num_clients):
        raise FedrayError(f"selector {name} picked a client outside 0..{context.num_clients - 1} in round "
                          f"{context.round}")
    if len(clients) > 1 and not np.diff(np.sort(clients)).all():
        raise FedrayError(f"selector {name} picked a client twice in round {context.round}")
    if not context.online(clients).all():
        raise FedrayError(f"selector {name} picked a client offline at the start of round {context.round}")
    return clients
