"""``--availability diurnal:PERIOD_S,DUTY``: each client is online for a fraction DUTY of every period, at a phase of
its own: online when ((t / PERIOD_S + phase_c) mod 1) < DUTY, phase_c uniform in [0, 1) from (seed, 43, client).

Its online intervals are [start_n, start_n + DUTY · PERIOD_S) with start_n = (n − phase_c) · PERIOD_S for every
integer n, computed by exactly these float64 expressions wherever they are used, so that ``next_available`` returns
a moment that ``available`` finds online and ``online_until`` one it finds offline (the formula with ``mod`` can
disagree with its own interval edges by a rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np

from fedray.core.errors import FedrayError
from fedray.core.numeric_options import check_positive
from fedray.clock.availability import Availability
from fedray.clock.streams import uniforms

STREAM = 43


@dataclass(frozen=True)
class DiurnalAvailability(Availability):
    """Diurnal availability: a period, a duty cycle, a phase drawn per client."""

    diurnal_period_s: Annotated[float, "the availability pattern's period, virtual seconds (a day: 86400)"] = 86400.0
    diurnal_duty: Annotated[float, "the fraction of each period a client is online, in (0, 1)"] = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive({"diurnal_period_s": self.diurnal_period_s})
        if not 0 < self.diurnal_duty < 1:
            raise FedrayError(f"--diurnal-duty must be in (0, 1) (1 is --availability always), got {self.diurnal_duty}")

    def phases(self, clients: np.ndarray) -> np.ndarray:
        """Each client's phase in [0, 1)."""
        return uniforms(self.seed, STREAM, clients)

    def check_rounds_can_fill(self, clients_per_round: int, num_clients: int) -> None:
        """Refuse when at no moment κ clients are online: the most clients online at once is the most phases of the
        population that fall in one arc of length DUTY of the circle [0, 1) (computed exactly, O(K log K) once)."""
        super().check_rounds_can_fill(clients_per_round, num_clients)
        phases = np.sort(self.phases(np.arange(num_clients)))
        around = np.concatenate([phases, phases + 1.0])
        most = int((np.searchsorted(around, phases + self.diurnal_duty, side="left") - np.arange(num_clients)).max())
        if most < clients_per_round:
            raise FedrayError(f"--availability diurnal:{self.diurnal_period_s:g},{self.diurnal_duty:g} has at most "
                              f"{most} of the {num_clients} clients online at once: a round of {clients_per_round} "
                              "never fills")

    def _available(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        phase = self.phases(clients)
        nearest = np.floor(t / self.diurnal_period_s + phase)
        online = np.zeros(clients.shape, dtype=bool)
        for n in (nearest - 1, nearest, nearest + 1):
            start = self._start(n, phase)
            online |= (start <= t) & (t < self._end(start))
        return online

    def _next_online(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        phase = self.phases(clients)
        nearest = np.floor(t / self.diurnal_period_s + phase)
        moment = np.full(clients.shape, np.inf)
        for n in (nearest + 2, nearest + 1, nearest, nearest - 1):
            start = self._start(n, phase)
            moment = np.where(start > t, start, moment)
        return moment

    def _online_end(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        phase = self.phases(clients)
        nearest = np.floor(t / self.diurnal_period_s + phase)
        moment = np.full(clients.shape, np.nan)
        for n in (nearest - 1, nearest, nearest + 1):
            start = self._start(n, phase)
            end = self._end(start)
            moment = np.where((start <= t) & (t < end), end, moment)
        return moment

    def _start(self, n: np.ndarray, phase: np.ndarray) -> np.ndarray:
        return (n - phase) * self.diurnal_period_s

    def _end(self, start: np.ndarray) -> np.ndarray:
        return start + self.diurnal_duty * self.diurnal_period_s
