"""When clients are online: the interface of an availability model, and ``always`` (the default).

A model answers, for an array of client ids at a virtual time t (float64 seconds since the run's start, t ≥ 0), with
no state and no memory of earlier lookups (each answer is a pure function of the run's seed, the client and t):

- ``available(clients, t)``: online at t;
- ``next_available(clients, t)``: the first moment ≥ t it is online (t itself when online now; +inf if never);
- ``online_until(clients, t)``: the end of the online interval holding t, the first moment after t it is offline
  (+inf if never; t itself when offline now);
- ``stays_available(clients, t0, t1)``: online during the whole of [t0, t1).

Every model's online intervals are half-open, [start, end): a client is online at its interval's start and offline
at its end, so one that finishes its work exactly when its interval ends has stayed online (``stays_available``
with t1 = end holds). t may be one number or an array like ``clients``.

Where the round logic checks availability: a round draws only among the clients ``available`` at its start; a
drawn client that goes offline before it finishes (``stays_available(c, start, finish)`` false) drops out.
:meth:`Availability.check_rounds_can_fill` refuses, before any work, a configuration where no round can ever find
κ clients online.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from fedray.core.errors import FedrayError


class Availability:
    """An availability model: stateless, vectorised lookups over arrays of client ids.

    Subclasses answer on checked arrays (client ids int64 ≥ 0, times float64 ≥ 0 of the same shape, one
    dimension): :meth:`_available`, and :meth:`_next_online` / :meth:`_online_end` for the clients found offline /
    online at t. Each costs O(κ) for κ clients (times a logarithm of a trace's length at most), never O(K).
    """

    def available(self, clients: np.ndarray, t: float | np.ndarray) -> np.ndarray:
        """Whether each client is online at t: a bool array like ``clients``."""
        clients, t = _lookup("available", clients, t)
        return self._available(clients, t)

    def next_available(self, clients: np.ndarray, t: float | np.ndarray) -> np.ndarray:
        """The first moment ≥ t each client is online: t when online at t, +inf if never."""
        clients, t = _lookup("next_available", clients, t)
        return self._next_available(clients, t)

    def online_until(self, clients: np.ndarray, t: float | np.ndarray) -> np.ndarray:
        """The first moment after t each client is offline (the end of its online interval holding t; +inf if it
        never goes offline), or t itself when it is offline at t."""
        clients, t = _lookup("online_until", clients, t)
        return self._online_until(clients, t)

    def stays_available(self, clients: np.ndarray, t0: float | np.ndarray, t1: float | np.ndarray) -> np.ndarray:
        """Whether each client is online during the whole of [t0, t1) (t1 ≥ t0; with t1 = t0: online at t0)."""
        clients, t0 = _lookup("stays_available", clients, t0)
        t1 = _times("stays_available", t1, clients.shape)
        if (t1 < t0).any():
            raise FedrayError("stays_available: an interval [t0, t1) ends before it starts (t1 < t0)")
        until = self._online_until(clients, t0.copy())
        return (until > t0) & (until >= t1)

    def check_rounds_can_fill(self, clients_per_round: int, num_clients: int) -> None:
        """Refuse (one line, before any work) a run whose rounds of ``clients_per_round`` clients, drawn among the
        ``num_clients`` clients online at a round's start, could never fill. Subclasses add their own test."""
        if not 1 <= clients_per_round <= num_clients:
            raise FedrayError(f"a round of {clients_per_round} clients cannot fill from a population of {num_clients}")

    @contextmanager
    def population_kept(self, num_clients: int) -> Iterator[None]:
        """Inside, what the model may keep of all ``num_clients`` clients to answer lookups over many of them, round
        after round (a closed form's hearing loop: :class:`~fedray.clock.hearing.StillToHear`), is kept; after, it
        is not (the lookups that follow ask about a round's clients). Nothing by default."""
        yield

    def _available(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _next_available(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        """:meth:`next_available` on checked arrays (``t`` a copy it may change): a model that answers both lookups
        from one pass over its clients' draws overrides it."""
        online = self._available(clients, t)
        t[~online] = self._next_online(clients[~online], t[~online])
        return t

    def _online_until(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        """:meth:`online_until` on checked arrays (``t`` a copy it may change), like :meth:`_next_available`."""
        online = self._available(clients, t)
        t[online] = self._online_end(clients[online], t[online])
        return t

    def _next_online(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        """For clients offline at t: the first moment after t they are online (+inf if never)."""
        raise NotImplementedError

    def _online_end(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        """For clients online at t: the first moment after t they are offline (+inf if never)."""
        raise NotImplementedError


@dataclass(frozen=True)
class AlwaysAvailable(Availability):
    """``--availability always`` (the default): every client online at every moment. The engine treats it as no
    availability model at all, so a run with it changes no bit."""

    def _available(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        return np.ones(clients.shape, dtype=bool)

    def _next_online(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        return np.full(clients.shape, np.inf)

    def _online_end(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        return np.full(clients.shape, np.inf)


def _lookup(what: str, clients: np.ndarray, t: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``clients`` as a 1-d int64 array of ids ≥ 0 and ``t`` as a float64 array of its shape (a fresh copy), or a
    one-line error naming ``what`` was asked."""
    ids = np.asarray(clients)
    if ids.ndim != 1 or not (ids.size == 0 or ids.dtype.kind in "iu"):
        raise FedrayError(f"{what}: clients must be a 1-d array of integer ids, got {ids.dtype} of shape {ids.shape}")
    if ids.size and ids.min() < 0:
        raise FedrayError(f"{what}: client ids must be ≥ 0, got {ids.min()}")
    ids = ids.astype(np.int64, copy=False)
    return ids, _times(what, t, ids.shape)


def _times(what: str, t: float | np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    times = np.asarray(t, dtype=np.float64)
    if times.ndim > 1 or (times.ndim == 1 and times.shape != shape):
        raise FedrayError(f"{what}: times must be one number or one per client ({shape[0]}), got shape {times.shape}")
    if not (np.isfinite(times).all() and (times >= 0).all()):
        raise FedrayError(f"{what}: times must be finite virtual seconds ≥ 0")
    return np.full(shape, times) if times.ndim == 0 else times.copy()
