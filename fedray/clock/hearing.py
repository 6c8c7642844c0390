"""Whom a closed form on the clock still has to hear: the component its rounds ask which clients a round may draw,
whether the stage is done, and which clients a scheduled row still asks.

A closed form uploads each client's statistics once. Without a clock its
stage hears every client of its schedule's rows (all K, or those of
``--rounds`` / ``--init-rounds`` rows). On the clock a client may be offline
at its turn or drop out before its upload arrives, so :class:`StillToHear`
keeps, over the K clients (O(K) once, O(κ) a round):

* the **target**: the clients of the schedule's rows, those the stage hears
  without a clock;
* the **eligible** mask: the target's clients not heard yet and not given up,
  the only clients a round draws beyond its row (the selector's candidates are
  the online eligible clients, :attr:`~fedray.clock.selector.RoundContext.eligible`);
* the clients each row asks (:meth:`StillToHear.row`): the row less those heard
  through another round's place (a fill for an offline client): their places
  go to eligible clients. A client that the schedule itself asks again (sampling
  with replacement, a second pass) keeps its place, as without a clock, where
  it has nothing to send and takes no time: so a clock that changes nothing
  (everyone online, no deadline, no over-commitment) asks the schedule's rows
  bit for bit.

Who of them is online at a round's start (:meth:`StillToHear.online`) is
looked up once, for every client still to hear, the first time it is asked
(O(K), vectorised, in chunks); each one found offline then waits in a calendar
by the moment it comes online next (exact, since it stays offline until then:
``next_available``), sorted once (O(K log K)). Later, a round looks up only the
clients found online before and those the calendar says have come online since
(O(κ) while they are few, as in a stage's tail, O(log K) each to put back), and
a round that must wait for one (:meth:`StillToHear.next_online`) reads the
calendar's first entry, so that it starts when that client comes online without
any lookup of the others (the clock does not ask its selector at the moment the
round would have started: :meth:`~fedray.clock.run_clock.RunClock.round`).
Asked again at the same moment with nobody heard since, it answers from the
last lookup.

Measured on a 2-core machine under a load of 8 to 16 (other runs), the
closed form's planning alone (``--devices phones --availability
diurnal:86400,0.3``, κ = 100, d = 16): at 10⁴ clients 7,075 rounds (100
scheduled), at 10⁵ 70,494 rounds (1,000 scheduled: the tail hears clients one
or two a round as they come online), 16.8 virtual hours; at 10⁵ 280 s of CPU
with one pass over the mask and availability lookups of every client still to
hear that may be online, a round, 66 s with the calendar (the same events), about
0.9 ms a round, left in the selector's, devices' and rounds' own per-round work.

The stage goes on after its schedule's rounds, numbered on, each asking up to
κ eligible clients, until none is left. A client whose upload is lost (it
dropped out, or straggled past a deadline) stays eligible and is asked again
in a later round, up to :data:`MAX_LOST` lost uploads: then it is given up, so
that a client whose online periods are all shorter than its task, or whose task
never meets the deadline, cannot hold the stage for ever (like a deployment's
server, which stops asking a client that keeps failing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedray.clock.availability import Availability

MAX_LOST = 10
"""Lost uploads (dropouts, stragglers) after which a closed form stops asking a client."""
LOOKUP_CHUNK = 1 << 16
"""Clients looked up at once: the first lookup's temporaries stay a few megabytes at any K."""
PROBE_CHUNK = 256
"""Clients :meth:`StillToHear.surely_online` looks up at once, until one is online."""
FIRST_CHUNK = 1024
"""Calendar entries looked at once for the first eligible one (:meth:`_Run.first`)."""


class StillToHear:
    """A closed form's clients still to hear on the clock (see the module's note)."""

    def __init__(self, num_clients: int, target: np.ndarray, availability: Availability | None = None) -> None:
        """``target``: a mask over the ``num_clients`` clients of those the stage hears without a clock;
        ``availability`` None: every client always online."""
        self.availability = availability
        self.eligible = np.asarray(target, dtype=bool).copy()
        """The target's clients neither heard nor given up: the mask a round's context carries."""
        self.remaining = int(self.eligible.sum())
        self.heard = np.zeros(num_clients, dtype=bool)
        self.scheduled = np.zeros(num_clients, dtype=bool)
        """The clients of the schedule's rows read so far."""
        self.lost = np.zeros(num_clients, dtype=np.uint8)
        """Each client's lost uploads, while eligible (so at most :data:`MAX_LOST`)."""
        self.given_up = 0
        self.found: int | None = None
        """How many eligible clients the last :meth:`online` found (None: not asked yet)."""
        self._online = np.zeros(0, dtype=np.int64)
        """The eligible clients the last :meth:`online` found online, by id."""
        self._calendar: _Calendar | None = None
        """The other eligible clients by the moment they next come online (None: :meth:`online` not asked yet)."""
        self._asked: float | None = None
        """The moment the last :meth:`online` looked up, while no client was heard or given up since."""

    @classmethod
    def of(cls, schedule: Sequence[np.ndarray], num_clients: int,
           availability: Availability | None = None) -> StillToHear:
        """The clients to hear of ``schedule``'s rows (one pass over them)."""
        target = np.zeros(num_clients, dtype=bool)
        for clients in schedule:
            target[clients] = True
        return cls(num_clients, target, availability)

    def online(self, t: float) -> np.ndarray:
        """The eligible clients online at ``t``, by id (``t`` no earlier than any moment asked before)."""
        if self.availability is None:
            clients = np.flatnonzero(self.eligible)
        elif t == self._asked:  # asked again before anyone was heard (a round's start, then its selector's pass)
            clients = self._online
        else:
            if self._calendar is None:
                maybe = np.flatnonzero(self.eligible)  # the first lookup: every client still to hear, O(K) once
                self._calendar = _Calendar()
            else:  # two increasing runs, merged in one pass by a stable (tim)sort rather than sorted afresh
                online, due = self._online[self.eligible[self._online]], self._calendar.due(t)
                maybe = np.sort(np.concatenate((online, np.sort(due[self.eligible[due]]))), kind="stable")
            clients, self._asked = self._look_up(maybe, t), t
        self.found = len(clients)
        return clients

    def next_online(self, t: float) -> float:
        """The first moment at or after ``t`` an eligible client is online (+inf if none ever is)."""
        if self.availability is None:
            return t if self.remaining else np.inf
        if len(self.online(t)):
            return t
        return self._calendar.first(self.eligible)

    def surely_online(self, t: float) -> bool:
        """Whether a client the last :meth:`online` found is still to hear and online at ``t``: a few lookups while the
        clients online are many (a stage's first rounds), and no change to what the hearing keeps."""
        for start in range(0, len(self._online), PROBE_CHUNK):
            part = self._online[start:start + PROBE_CHUNK]
            part = part[self.eligible[part]]
            if len(part) and self.availability.available(part, t).any():
                return True
        return False

    def _look_up(self, maybe: np.ndarray, t: float) -> np.ndarray:
        """Of ``maybe`` (eligible clients by id, each either found online before or due to come online by ``t``), those
        online at ``t``; the others wait in the calendar until they next come online (never again: not kept)."""
        moments = np.empty(len(maybe))
        for start in range(0, len(maybe), LOOKUP_CHUNK):  # a first lookup of 10⁶ clients in bounded memory
            part = slice(start, start + LOOKUP_CHUNK)
            moments[part] = self.availability.next_available(maybe[part], t)
        self._online = maybe[moments == t]
        later = np.isfinite(moments) & (moments > t)
        self._calendar.add(moments[later], maybe[later])
        return self._online

    def row(self, scheduled: np.ndarray) -> np.ndarray:
        """The clients of the schedule's next row that the round still asks, in their order: the row less the clients
        heard through another round's place (read in order, once each)."""
        scheduled = np.asarray(scheduled, dtype=np.int64)
        asked = scheduled[self.scheduled[scheduled] | ~self.heard[scheduled]]
        self.scheduled[scheduled] = True
        return asked

    def hear(self, clients: np.ndarray, lost: np.ndarray) -> None:
        """A round's kept uploads (``clients``) and its ``lost`` ones."""
        self.heard[clients] = True
        lost = lost[self.eligible[lost]]
        self.lost[lost] += 1
        given_up = lost[self.lost[lost] >= MAX_LOST]
        done = np.concatenate((clients[self.eligible[clients]], given_up))
        self.eligible[done] = False
        self._asked = None
        self.remaining -= len(done)
        self.given_up += len(given_up)


class _Calendar:
    """Clients by the moment they next come online, earliest first (ties by id): sorted runs of numpy arrays (16 bytes
    an entry), the first lookup's sorted once (O(K log K)), each later lookup's a run of its own, merged with the run
    before while that one is at most twice its size (so a few runs, O(log K) each entry over its life). Entries of
    clients no longer eligible are dropped as they come up."""

    def __init__(self) -> None:
        self._runs: list[_Run] = []

    def add(self, moments: np.ndarray, clients: np.ndarray) -> None:
        if not len(moments):
            return
        self._runs.append(_Run.of(moments, clients))
        while len(self._runs) > 1 and len(self._runs[-2]) <= 2 * len(self._runs[-1]):
            later = self._runs.pop()
            self._runs[-1] = self._runs[-1].merged(later)

    def due(self, t: float) -> np.ndarray:
        """The clients that come online at or before ``t``, taken out."""
        due = [run.due(t) for run in self._runs]
        self._runs = [run for run in self._runs if len(run)]
        return np.concatenate(due) if len(due) > 1 else due[0] if due else np.zeros(0, dtype=np.int64)

    def first(self, eligible: np.ndarray) -> float:
        """The earliest moment of an ``eligible`` client's (+inf if none), entries of others dropped."""
        return min((run.first(eligible) for run in self._runs), default=np.inf)


@dataclass
class _Run:
    """Entries sorted by (moment, client); those before ``head`` taken out."""

    moments: np.ndarray
    clients: np.ndarray
    head: int = 0

    @classmethod
    def of(cls, moments: np.ndarray, clients: np.ndarray) -> _Run:
        order = np.lexsort((clients, moments))
        return cls(moments[order], clients[order])

    def __len__(self) -> int:
        return len(self.moments) - self.head

    def merged(self, other: _Run) -> _Run:
        return _Run.of(np.concatenate((self.moments[self.head:], other.moments[other.head:])),
                       np.concatenate((self.clients[self.head:], other.clients[other.head:])))

    def due(self, t: float) -> np.ndarray:
        end = max(int(np.searchsorted(self.moments, t, side="right")), self.head)
        due, self.head = self.clients[self.head:end], end
        return due

    def first(self, eligible: np.ndarray) -> float:
        """This run's earliest moment of an ``eligible`` client (+inf if none), the entries of others before it
        taken out."""
        while self.head < len(self.clients):
            ahead = np.flatnonzero(eligible[self.clients[self.head:self.head + FIRST_CHUNK]])
            if len(ahead):
                self.head += int(ahead[0])
                return float(self.moments[self.head])
            self.head += FIRST_CHUNK
        self.head = len(self.clients)
        return np.inf
