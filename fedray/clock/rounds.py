"""The synchronous round on the clock: who of the selected clients finishes, who is late, who drops out, and when the
round ends — a pure function of the clients' durations, the round's start and who stays online.

:class:`SynchronousRounds` is the scheduler component the engine's event loop
calls once a round (its options: ``over_commit``, ``deadline``,
``stragglers``). Each selected client downloads the model, computes its
``local_steps`` steps at an even pace (``compute_s`` in all) and uploads
(``comm_s`` for both transfers), so it would finish at start + comm_s +
compute_s. Then, in this order:

* **stragglers**: a client that would finish after the deadline. With
  ``drop`` its upload is lost. With ``partial`` it stops computing in time to
  upload by the deadline and sends the ⌊(deadline − comm_s) / compute_s ·
  local_steps⌋ steps it completed (FedNova's normalised averaging weighs them),
  finishing at start + comm_s + steps · compute_s / local_steps; with no step
  done its upload is lost.
* **dropouts**: a client not online for all of [start, its finish) (the
  availability model's ``stays_available``; it was online at the start, which
  the selector checked; going offline as its upload arrives is in time): its compute is spent, its upload lost, its state
  unchanged.
* **over-commitment**: of the clients whose uploads arrive, the round keeps
  the first ``keep`` (κ) by (finish time, client id).

The round ends when its ``keep``-th upload arrives; failing that, when the
fate of every selected client is known: a finisher's at its finish, a
dropout's at its planned finish (when the server stops waiting for it), a lost
straggler's at the deadline. A client whose upload arrives after the first
``keep``, or whose fate is not known when the round ends (still computing, late
or bound to drop out after the end), is cut: it counts as neither a straggler
nor a dropout. Only the kept clients' uploads are needed, so only
they need be trained: a straggler, a dropout and a cut client are all known
before any training (the simulation is cheaper than the system it simulates).
Every ordering is by (virtual time, client id), never by the order of the
arrays given.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Annotated, Literal

import numpy as np

from fedray.clock.lookups import AvailabilityLookup
from fedray.core.errors import FedrayError
from fedray.core.options import Metavar, Unset

STRAGGLERS = ("drop", "partial")


@dataclass(frozen=True)
class RoundOutcome:
    """A synchronous round's result. Client arrays are int64; ``finished`` in the order uploads arrive (time, then
    id), the other lists by client id."""

    start_s: float
    end_s: float
    finished: np.ndarray
    """The clients whose uploads the round keeps: the only ones that need be trained."""
    finish_s: np.ndarray
    """When each of ``finished`` uploads."""
    steps: np.ndarray | None
    """The local steps each of ``finished`` takes (a partial straggler's fewer), where the round was told them."""
    stragglers: np.ndarray
    """Clients not done by the deadline (with ``partial``, those that sent some steps are in ``finished`` too)."""
    dropped: np.ndarray
    """Clients offline before they finished: compute spent, upload lost."""
    cut: np.ndarray
    """Clients not needed: their uploads came after the first ``keep``, or the round ended before their fate was
    known. Every selected client is in exactly one of ``finished``, ``cut``, ``dropped`` and the stragglers whose
    uploads were lost."""
    kept: np.ndarray
    """Where each of ``finished`` is among the clients the round was given (their positions, int64)."""


@functools.lru_cache(maxsize=256)
def _exact_ceil(factor: float, count: int) -> int:
    """⌈factor · count⌉ of the decimal ``factor`` as written (1.1 · 10 is 11, not 12 as in floating point)."""
    return int(-(-Fraction(repr(factor)) * count // 1))


@dataclass(frozen=True)
class SynchronousRounds:
    """Synchronous rounds on the clock (see the module's note); the defaults change nothing: every selected client
    is kept, however long it takes (None: the option is not set, and means what its ``Unset`` says)."""

    over_commit: Annotated[float | None, "ask ⌈o·κ⌉ clients a round and keep the first κ to finish (FedScale's "
                                         "default is 1.3)", Unset("1: no over-commitment"), Metavar("O")] = None
    deadline: Annotated[float | None, "seconds after a round's start by which uploads must arrive; later clients are "
                                      "stragglers", Unset("none"), Metavar("S")] = None
    stragglers: Annotated[Literal["drop", "partial"] | None, "a straggler's upload: drop it, or partial (the local "
                                                             "steps it finished by the deadline, FedNova's setting)",
                          Unset("drop")] = None

    def __post_init__(self) -> None:
        if self.over_commit is not None and (not self.over_commit >= 1 or not np.isfinite(self.over_commit)):
            raise FedrayError(f"--over-commit must be a finite number ≥ 1, got {self.over_commit}")
        if self.deadline is not None and (not self.deadline > 0 or not np.isfinite(self.deadline)):
            raise FedrayError(f"--deadline must be a finite number of seconds > 0, got {self.deadline}")
        if self.stragglers is not None and self.stragglers not in STRAGGLERS:
            raise FedrayError(f"--stragglers must be drop or partial, got {self.stragglers!r}")

    def wanted(self, scheduled: int, num_clients: int) -> int:
        """How many clients a round of ``scheduled`` asks for: ⌈o · scheduled⌉, at most the federation's."""
        return min(_exact_ceil(self.over_commit or 1.0, scheduled), num_clients)

    @property
    def partial(self) -> bool:
        """Whether a straggler sends the steps it finished by the deadline (``--stragglers partial``)."""
        return self.stragglers == "partial"

    def run(self, clients: np.ndarray, compute_s: np.ndarray, comm_s: np.ndarray, start_s: float, keep: int,
            local_steps: np.ndarray | None = None, availability: AvailabilityLookup | None = None) -> RoundOutcome:
        """The round of the selected ``clients`` (distinct) started at ``start_s``, keeping the first ``keep``
        uploads; ``compute_s``, ``comm_s`` and ``local_steps`` are per client, aligned with ``clients``;
        ``availability`` None: every client stays online."""
        clients, compute_s, comm_s = _checked(clients, compute_s, comm_s, keep)
        if local_steps is not None:
            local_steps = np.asarray(local_steps, dtype=np.int64)
            if local_steps.shape != clients.shape or (local_steps < 1).any():
                raise FedrayError("a round's local_steps must be one count ≥ 1 per selected client")
        elif self.partial:
            raise FedrayError("--stragglers partial needs each client's local steps")

        duration = comm_s + compute_s
        finish = start_s + duration
        steps = local_steps
        late = np.zeros(len(clients), dtype=bool) if self.deadline is None else duration > self.deadline
        arrives = ~late
        if self.partial and late.any():
            steps, finish, arrives = self._partial(compute_s, comm_s, start_s, local_steps, finish, late)
        resolved = np.where(late & ~arrives, start_s + (self.deadline or 0.0), finish)
        online = np.ones(len(clients), dtype=bool)
        if availability is not None and arrives.any():
            online[arrives] = availability.stays_available(clients[arrives], start_s, finish[arrives])
        dropped = arrives & ~online
        arrives &= online

        order = np.flatnonzero(arrives)[np.lexsort((clients[arrives], finish[arrives]))]
        kept = order[:keep]
        end_s = float(finish[kept[-1]]) if keep and len(kept) == keep else float(resolved.max(initial=start_s))
        not_kept = np.ones(len(clients), dtype=bool)
        not_kept[kept] = False
        cut = (arrives | (resolved > end_s)) & not_kept
        return RoundOutcome(
            start_s=start_s, end_s=end_s, finished=clients[kept], finish_s=finish[kept],
            steps=None if steps is None else steps[kept], stragglers=np.sort(clients[late & ~cut]),
            dropped=np.sort(clients[dropped & ~cut]), cut=np.sort(clients[cut]), kept=kept)

    def _partial(self, compute_s: np.ndarray, comm_s: np.ndarray, start_s: float, local_steps: np.ndarray,
                 finish: np.ndarray, late: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The late clients' steps done by the deadline, their finish, and whether their upload arrives (≥ 1 step)."""
        spare = self.deadline - comm_s[late]
        with np.errstate(divide="ignore", invalid="ignore"):
            done = np.floor(np.where(compute_s[late] > 0, spare / compute_s[late], 0.0) * local_steps[late])
        done = np.clip(done, 0, local_steps[late] - 1).astype(np.int64)
        steps, finish = local_steps.copy(), finish.copy()
        steps[late] = done
        pace = compute_s[late] / local_steps[late]
        finish[late] = start_s + np.minimum(comm_s[late] + done * pace, self.deadline)
        return steps, finish, ~late | (steps > 0)


def _checked(clients: np.ndarray, compute_s: np.ndarray, comm_s: np.ndarray,
             keep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The round's inputs as arrays, or a one-line error naming what is wrong."""
    clients = np.asarray(clients, dtype=np.int64)
    compute_s, comm_s = np.asarray(compute_s, dtype=np.float64), np.asarray(comm_s, dtype=np.float64)
    if clients.ndim != 1 or compute_s.shape != clients.shape or comm_s.shape != clients.shape:
        raise FedrayError(f"a round needs one compute_s and one comm_s per selected client, got {len(clients)} "
                          f"clients, {compute_s.size} compute_s and {comm_s.size} comm_s")
    for name, seconds in (("compute_s", compute_s), ("comm_s", comm_s)):
        bad = ~(np.isfinite(seconds) & (seconds >= 0))
        if bad.any():
            raise FedrayError(f"a round's {name} must be finite seconds ≥ 0, got {seconds[bad][0]} for client "
                              f"{clients[bad][0]}")
    if len(clients) > 1 and not np.diff(np.sort(clients)).all():
        raise FedrayError("a round's selected clients must be distinct")
    if keep < 0:
        raise FedrayError(f"a round keeps ≥ 0 uploads, got {keep}")
    return clients, compute_s, comm_s
