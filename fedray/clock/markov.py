"""``--availability markov:ON_S,OFF_S``: each client alternates online and offline periods, exponential with means
ON_S and OFF_S, from a stationary start, its own realisation from the stream (seed, 42, client).

The process is built so that any lookup is a pure function of (seed, client, t), with no state: by uniformisation,
a two-state Markov process with rates a = 1/ON_S (online → offline) and b = 1/OFF_S is a Poisson clock of rate
λ = a + b at whose every tick the state is drawn afresh, online with probability p = ON_S / (ON_S + OFF_S),
whatever it was (from online, the chance to leave is λ(1 − p) = a; from offline, to come back λp = b); the state at
t = 0 is drawn with the same p, the stationary law. The clock's ticks are laid out in blocks of length 1/λ: block k's
ticks are k/λ plus the running sums of exponential gaps drawn from counters (k, slot), kept while they fall inside
the block (a Poisson process restarted at each block's start is still one, being memoryless). The state at t is the
draw of the last tick ≤ t (found by scanning back block by block: about 1.6 blocks on average), the next change is
the first later tick that draws the other state: O(κ) work for κ clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np

from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.core.numeric_options import check_positive
from fedray.clock.availability import Availability
from fedray.clock.streams import uniforms

stats = lazy_module("scipy.stats", globals())  # seconds to import; only a Markov availability uses it

STREAM = 42
MAX_BLOCKS = 2**32
"""A tick's counter is block · 2³² + its slot's draws, so lookups reach 2³² mean gaps (with 1-minute periods,
about 4,000 years)."""
FILL_PROBABILITY = 1e-6
""":meth:`MarkovAvailability.check_rounds_can_fill` refuses when fewer moments than this have κ clients online."""

_INITIAL = 0
"""The counter of the state at t = 0; a tick's gap and state have counters 2 + 2·slot (+ 1) within its block."""


@dataclass(frozen=True)
class MarkovAvailability(Availability):
    """Two-state Markov availability: exponential online and offline periods, a stationary start, a realisation
    per client."""

    markov_on_s: Annotated[float, "mean online period, virtual seconds"] = 3600.0
    markov_off_s: Annotated[float, "mean offline period, virtual seconds"] = 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive({"markov_on_s": self.markov_on_s, "markov_off_s": self.markov_off_s})

    @property
    def online_fraction(self) -> float:
        """p = ON_S / (ON_S + OFF_S): the chance a client is online at any given moment."""
        return self.markov_on_s / (self.markov_on_s + self.markov_off_s)

    @property
    def block_s(self) -> float:
        """The length of a block of ticks, the clock's mean gap 1/λ = ON_S · OFF_S / (ON_S + OFF_S)."""
        return 1.0 / (1.0 / self.markov_on_s + 1.0 / self.markov_off_s)

    def check_rounds_can_fill(self, clients_per_round: int, num_clients: int) -> None:
        """Refuse when at a given moment (the process is stationary: at any moment) κ of the K clients are online
        with probability below 10⁻⁶: P(Binomial(K, p) ≥ κ) < 10⁻⁶, rounds would wait practically forever."""
        super().check_rounds_can_fill(clients_per_round, num_clients)
        chance = stats.binom.sf(clients_per_round - 1, num_clients, self.online_fraction)
        if chance < FILL_PROBABILITY:
            raise FedrayError(
                f"--availability markov:{self.markov_on_s:g},{self.markov_off_s:g} keeps {self.online_fraction:.3g} "
                f"of the {num_clients} clients online ({num_clients * self.online_fraction:.1f} on average): a round "
                f"of {clients_per_round} fills at fewer than {FILL_PROBABILITY:g} of moments")

    def _available(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        block = self._blocks(t)
        online = np.zeros(clients.shape, dtype=bool)
        pending = np.arange(clients.size)
        upper = t.copy()
        while pending.size:
            found, state = self._last_tick(clients[pending], block[pending], upper[pending])
            online[pending[found]] = state[found]
            pending = pending[~found]
            block[pending] -= 1
            upper[pending] = np.inf
            started = pending[block[pending] < 0]
            online[started] = self._draw_state(clients[started], np.full(started.size, _INITIAL, dtype=np.uint64))
            pending = pending[block[pending] >= 0]
        return online

    def _next_online(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        return self._first_tick_drawing(True, clients, t)

    def _online_end(self, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        return self._first_tick_drawing(False, clients, t)

    def _blocks(self, t: np.ndarray) -> np.ndarray:
        block = np.floor(t / self.block_s)
        if block.size and block.max() >= MAX_BLOCKS:
            raise FedrayError(f"--availability markov: lookups reach {MAX_BLOCKS * self.block_s:.3g} virtual seconds "
                              f"at most, got t = {t.max():.3g}")
        return block.astype(np.int64)

    def _last_tick(self, clients: np.ndarray, block: np.ndarray, upper: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Whether each client's ``block`` has a tick at or before ``upper``, and the state the last such tick draws."""
        found = np.zeros(clients.shape, dtype=bool)
        state = np.zeros(clients.shape, dtype=bool)
        position = block * self.block_s
        end = (block + 1) * self.block_s
        active = np.arange(clients.size)
        slot = 0
        while active.size:
            position[active] += self._gap(clients[active], block[active], slot)
            active = active[(position[active] < end[active]) & (position[active] <= upper[active])]
            state[active] = self._draw_state(clients[active], _counter(block[active], 3 + 2 * slot))
            found[active] = True
            slot += 1
        return found, state

    def _first_tick_drawing(self, wanted: bool, clients: np.ndarray, t: np.ndarray) -> np.ndarray:
        """The first tick after t that draws the state ``wanted``, for each client."""
        block = self._blocks(t)
        moment = np.full(clients.shape, np.nan)
        pending = np.arange(clients.size)
        while pending.size:
            position = block[pending] * self.block_s
            end = (block[pending] + 1) * self.block_s
            active = np.arange(pending.size)
            slot = 0
            while active.size:
                position[active] += self._gap(clients[pending[active]], block[pending[active]], slot)
                active = active[position[active] < end[active]]
                later = active[position[active] > t[pending[active]]]
                draws = self._draw_state(clients[pending[later]], _counter(block[pending[later]], 3 + 2 * slot))
                hit = later[draws == wanted]
                moment[pending[hit]] = position[hit]
                active = np.setdiff1d(active, hit, assume_unique=True)
                slot += 1
            pending = pending[np.isnan(moment[pending])]
            block[pending] += 1
            if pending.size and block[pending].max() >= MAX_BLOCKS:
                raise FedrayError(f"--availability markov: lookups reach {MAX_BLOCKS * self.block_s:.3g} virtual "
                                  "seconds at most")
        return moment

    def _gap(self, clients: np.ndarray, block: np.ndarray, slot: int) -> np.ndarray:
        """The exponential gap (mean 1/λ) before a block's tick ``slot``."""
        return -np.log1p(-uniforms(self.seed, STREAM, clients, _counter(block, 2 + 2 * slot))) * self.block_s

    def _draw_state(self, clients: np.ndarray, counter: np.ndarray) -> np.ndarray:
        return uniforms(self.seed, STREAM, clients, counter) < self.online_fraction


def _counter(block: np.ndarray, within: int) -> np.ndarray:
    return block.astype(np.uint64) * np.uint64(MAX_BLOCKS) + np.uint64(within)
