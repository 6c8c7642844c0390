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

Who of them is online at a round's start (:meth:`StillToHear.online`) is one
pass over the eligible clients that may be online: each one found offline
keeps the moment it comes online next (exact, since it stays offline until
then), and is not looked up again before that moment, as a round's start never
goes back. A round where few clients still to hear are online, or one that must
wait for one (:meth:`StillToHear.next_online`), then costs a few scans of the
K-entry mask and availability lookups of the clients online or coming online
since the last pass only, not of all the clients still to hear.

Measured once on a 2-core machine under a load of about 12: a 10⁵-client
Fed3R stage (d = 128) on ``phones`` with ``diurnal:86400,0.3``, κ = 100, its
1,000 scheduled rounds then 67,781 more (the stage's tail hears clients one or
two a round as they come online, 60,461 rounds waiting for one), took 786 s of
round loop, 11 ms a round, for 16.9 virtual hours. At 10⁶ clients a scan of
the mask costs about 14 ms there (a few a round in the tail), while a client
still to hear comes online every 0.09 virtual seconds, so that the tail's
rounds fill and number fewer than the clients.

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

import numpy as np

from fedray.clock.availability import Availability

MAX_LOST = 10
"""Lost uploads (dropouts, stragglers) after which a closed form stops asking a client."""


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
        self.lost = np.zeros(num_clients, dtype=np.int64)
        self.given_up = 0
        self.online_from = np.zeros(num_clients)
        """For an eligible client, a moment before which it is offline (from the last lookup that found it so)."""
        self.found: int | None = None
        """How many eligible clients the last :meth:`online` found (None: not asked yet)."""

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
        clients = np.flatnonzero(self.eligible)
        if self.availability is not None:
            maybe = clients[self.online_from[clients] <= t]
            self.online_from[maybe] = self.availability.next_available(maybe, t)
            clients = maybe[self.online_from[maybe] == t]
        self.found = len(clients)
        return clients

    def next_online(self, t: float) -> float:
        """The first moment at or after ``t`` an eligible client is online (+inf if none ever is)."""
        if self.availability is None:
            return t if self.remaining else np.inf
        self.online(t)
        return float(self.online_from[self.eligible].min(initial=np.inf))

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
        self.remaining -= len(done)
        self.given_up += len(given_up)
