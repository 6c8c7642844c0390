"""``--availability diurnal:PERIOD_S,DUTY``: each client is online for a fraction DUTY of every period, at a phase of
its own: online when ((t / PERIOD_S + phase_c) mod 1) < DUTY, phase_c uniform in [0, 1) from (seed, 43, client).

Its online intervals are [start_n, start_n + DUTY · PERIOD_S) with start_n = (n − phase_c) · PERIOD_S for every
integer n, computed by exactly these float64 expressions wherever they are used, so that ``next_available`` returns
a moment that ``available`` finds online and ``online_until`` one it finds offline (the formula with ``mod`` can
disagree with its own interval edges by a rounding).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated

import numpy as np

from fedray.core.errors import FedrayError
from fedray.core.numeric_options import check_positive
from fedray.clock.availability import Availability
from fedray.clock.streams import uniforms

STREAM = 43
AROUND = np.array([-1.0, 0.0, 1.0])[:, None]
"""The intervals that may hold t, by n relative to ⌊t / PERIOD_S + phase⌋ (one either side for the roundings)."""
AHEAD = np.array([-1.0, 0.0, 1.0, 2.0])[:, None]
"""The intervals among which the next one to start after t is."""


@dataclass(frozen=True)
class DiurnalAvailability(Availability):
    """Diurnal availability: a period, a duty cycle, a phase drawn per client."""

    diurnal_period_s: Annotated[float, "the availability pattern's period, virtual seconds (a day: 86400)"] = 86400.0
    diurnal_duty: Annotated[float, "the fraction of each period a client is online, in (0, 1)"] = 0.5
    seed: int = 0
    _population_phases: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    """Every client's phase, kept by :meth:`check_rounds_can_fill` and :meth:`population_kept` (None: not kept)."""

    def __post_init__(self) -> None:
        check_positive({"diurnal_period_s": self.diurnal_period_s})
        if not 0 < self.diurnal_duty < 1:
            raise FedrayError(f"--diurnal-duty must be in (0, 1) (1 is --availability always), got {self.diurnal_duty}")

    def phases(self, clients: np.ndarray) -> np.ndarray:
        """Each client's phase in [0, 1): from the population's phases where :meth:`check_rounds_can_fill` drew them
        (the same numbers), else drawn."""
        clients = np.asarray(clients)
        population = self._population_phases
        if population is not None and clients.size and clients.max() < len(population) and clients.min() >= 0:
            return population[clients]
        return uniforms(self.seed, STREAM, clients)

    def check_rounds_can_fill(self, clients_per_round: int, num_clients: int) -> None:
        """Refuse when at no moment κ clients are online: the most clients online at once is the most phases of the
        population that fall in one arc of length DUTY of the circle [0, 1) (computed exactly, O(K log K) once). The
        population's phases are kept for the lookups that follow (8 bytes a client), until a closed form's hearing
        loop is done with them (:meth:`population_kept`): a round's lookups then read its clients' phases instead of
        hashing them again, several times a round."""
        super().check_rounds_can_fill(clients_per_round, num_clients)
        population = uniforms(self.seed, STREAM, np.arange(num_clients))
        object.__setattr__(self, "_population_phases", population)
        phases = np.sort(population)
        around = np.concatenate([phases, phases + 1.0])
        most = int((np.searchsorted(around, phases + self.diurnal_duty, side="left") - np.arange(num_clients)).max())
        if most < clients_per_round:
            raise FedrayError(f"--availability diurnal:{self.diurnal_period_s:g},{self.diurnal_duty:g} has at most "
                              f"{most} of the {num_clients} clients online at once: a round of {clients_per_round} "
                              "never fills")

    @contextmanager
    def population_kept(self, num_clients: int) -> Iterator[None]:
        """Every client's phase kept inside (drawn where :meth:`check_rounds_can_fill` has not kept them), and not
        after: at a million clients, 8 MB the driver would otherwise hold to the run's end for the lookups that
        follow, of a round's clients, which hash just those."""
        if self._population_phases is None or len(self._population_phases) != num_clients:
            object.__setattr__(self, "_population_phases", uniforms(self.seed, STREAM, np.arange(num_clients)))
        try:
            yield
        finally:
            object.__setattr__(self, "_population_phases", None)

    def _available(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        return self._online(self.phases(clients), t)

    def _next_online(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        return self._next_start(self.phases(clients), t)

    def _online_end(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        return self._end_of_online(self.phases(clients), t)

    def _next_available(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        phase = self.phases(clients)
        offline = ~self._online(phase, t)
        t[offline] = self._next_start(phase[offline], t[offline])
        return t

    def _online_until(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        phase = self.phases(clients)
        online = self._online(phase, t)
        t[online] = self._end_of_online(phase[online], t[online])
        return t

    def _online(self, phase: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Whether a client of ``phase`` is online at ``t``: in one of the intervals around it."""
        starts = self._starts(phase, t, AROUND)
        return ((starts <= t) & (t < self._end(starts))).any(axis=0)

    def _next_start(self, phase: np.ndarray, t: np.ndarray) -> np.ndarray:
        """For clients of ``phase`` offline at ``t``: when their next online interval starts (the first of the
        intervals around and after it that starts after ``t``: their starts increase with n)."""
        starts = self._starts(phase, t, AHEAD)
        return np.where(starts > t, starts, np.inf).min(axis=0)

    def _end_of_online(self, phase: np.ndarray, t: np.ndarray) -> np.ndarray:
        """For clients of ``phase`` online at ``t``: when the online interval holding ``t`` ends."""
        starts = self._starts(phase, t, AROUND)
        ends = self._end(starts)
        holds = (starts <= t) & (t < ends)
        moment = np.full(phase.shape, np.nan)
        for row in range(len(AROUND)):
            moment = np.where(holds[row], ends[row], moment)
        return moment

    def _starts(self, phase: np.ndarray, t: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """The starts of the intervals n = ⌊t / PERIOD_S + phase⌋ + each of ``offsets``, one row an offset."""
        return self._start(np.floor(t / self.diurnal_period_s + phase) + offsets, phase)

    def _start(self, n: np.ndarray, phase: np.ndarray) -> np.ndarray:
        return (n - phase) * self.diurnal_period_s

    def _end(self, start: np.ndarray) -> np.ndarray:
        return start + self.diurnal_duty * self.diurnal_period_s
