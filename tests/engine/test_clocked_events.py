"""The clock's events pinned: every field of every round a clock plans, for devices, availability models, schedulers
and selectors, hashed and compared with the hash of the events as they were first written. A change that only makes
the planning faster (or leaner) must leave these hashes as they are; a change that means to move an event must say
why, and update the pin with the reason in its commit."""

import hashlib

import numpy as np
import pytest

from fedray.clock.costs import TaskCost
from fedray.clock.devices import Devices
from fedray.clock.diurnal import DiurnalAvailability
from fedray.clock.markov import MarkovAvailability
from fedray.clock.rounds import SynchronousRounds
from fedray.clock.run_clock import ClockedRound, RunClock
from fedray.clock.selector import PoissonSelector, UniformSelector
from fedray.clock.traces import TraceAvailability
from fedray.engine.clocked import ClosedFormTasks, clocked_closed_form

CLIENTS, PER_ROUND, SEED = 240, 8, 11
ROUNDS = 12
"""Training rounds a training configuration plans."""
TRACES = """trace_id,start_s,end_s
0,0,400
0,900,2000
1,100,300
1,500,1500
1,1700,1900
2,0,2000
3,1200,1800
"""
"""Four traces over a span of 2,000 s: one always online, three with gaps."""


def availability(name: str, tmp_path):
    if name == "diurnal":
        return DiurnalAvailability(4000.0, 0.3, seed=SEED)
    if name == "day":  # jobs.bench_scale --clock's: rounds much shorter than the time offline, a long tail
        return DiurnalAvailability(86400.0, 0.3, seed=SEED)
    if name == "markov":
        return MarkovAvailability(300.0, 600.0, seed=SEED)
    if name == "trace":
        path = tmp_path / "traces.csv"
        path.write_text(TRACES)
        return TraceAvailability(str(path), seed=SEED)
    return None


class KeptUniform(UniformSelector):
    """The built-in, its clients' history kept (the built-ins read none) for the hash to cover the durations too."""

    reads_history = True


class KeptPoisson(PoissonSelector):
    reads_history = True


def run_clock(devices: str, available: str, tmp_path, poisson: bool = False, **rounds) -> RunClock:
    """A clock as the engine builds it (:func:`fedray.engine.clocked.run_clock`: the clients' devices assigned, the
    availability checked)."""
    selector = KeptPoisson() if poisson else KeptUniform()
    model = availability(available, tmp_path)
    if model is not None:
        model.check_rounds_can_fill(PER_ROUND, CLIENTS)
    table = Devices(devices)
    table.assign(CLIENTS, SEED)
    return RunClock(table, model, SynchronousRounds(**rounds), selector,
                    "poisson" if poisson else "uniform", CLIENTS, PER_ROUND, SEED, sized_by_draw=poisson)


def schedule(poisson: bool = False) -> list[np.ndarray]:
    """Rows of a uniform permutation (every client once) or of Poisson sampling at rate κ / K."""
    rng = np.random.default_rng(SEED)
    if poisson:
        return [np.flatnonzero(rng.random(CLIENTS) < PER_ROUND / CLIENTS) for _ in range(ROUNDS)]
    order = rng.permutation(CLIENTS)
    return [order[start:start + PER_ROUND] for start in range(0, CLIENTS, PER_ROUND)]


SIZES = np.random.default_rng(SEED + 1).integers(1, 40, CLIENTS).astype(np.float64)
CLOSED_FORM = ClosedFormTasks(SIZES * 2e9, np.full(CLIENTS, 4e6), 25)
"""A closed form's task: 2·10⁹ multiply-adds a sample, 4 MB up."""
STEPS = (SIZES // 8 + 1).astype(np.int64)


def training_costs(clients: np.ndarray) -> TaskCost:
    return TaskCost(SIZES[clients] * 5e9, 2e6, 2e6)


def hashed(clocked: tuple[RunClock, list[ClockedRound]]) -> tuple[int, str]:
    """The clock's rounds and a hash of every field of each (its arrays as int64 or float64 bytes)."""
    clock, records = clocked
    digest = hashlib.sha256()
    for record in records:
        digest.update(record.stage.encode())
        for value in (record.number, record.stragglers, record.dropped, record.selected, record.clients, record.lost,
                      -1 if record.steps is None else record.steps):
            digest.update(np.asarray(value, dtype=np.int64).tobytes())
        for value in (record.start_s, record.end_s, record.bytes_up, record.bytes_down, record.compute_s,
                      record.comm_s):
            digest.update(np.float64(value).tobytes())
    digest.update(np.asarray(clock.history.duration_s).tobytes())
    return len(records), digest.hexdigest()[:16]


def closed_form(clock: RunClock) -> tuple[RunClock, list[ClockedRound]]:
    return clock, clocked_closed_form(clock, schedule(), CLOSED_FORM, "closed_form")


def training(clock: RunClock, poisson: bool = False) -> tuple[RunClock, list[ClockedRound]]:
    return clock, [clock.round(number, "train", row, training_costs, lambda clients: STEPS[clients])
                   for number, row in enumerate(schedule(poisson)[:ROUNDS], start=1)]


PINNED = {
    "closed form, uniform devices, always": (
        lambda tmp: closed_form(run_clock("uniform", "always", tmp)), (30, "36ffb5536991bdeb")),
    "closed form, phones, diurnal": (
        lambda tmp: closed_form(run_clock("phones", "diurnal", tmp)), (34, "02e0c8a5c6ab379b")),
    "closed form, phones, a day": (
        lambda tmp: closed_form(run_clock("phones", "day", tmp)), (176, "0757375b9ef252e9")),
    "closed form, phones, markov, deadline": (
        lambda tmp: closed_form(run_clock("phones", "markov", tmp, deadline=60.0)), (126, "f7f239b3615a85df")),
    "closed form, phones, trace, over-commitment": (
        lambda tmp: closed_form(run_clock("phones", "trace", tmp, over_commit=1.3)), (33, "2c90723c624b7e94")),
    "training, phones, diurnal, over-commitment": (
        lambda tmp: training(run_clock("phones", "diurnal", tmp, over_commit=1.3)), (12, "4a5f51a67d45a07c")),
    "training, phones, markov, deadline": (
        lambda tmp: training(run_clock("phones", "markov", tmp, deadline=80.0)), (12, "02086f15ef59f5d3")),
    "training, phones, trace, partial stragglers": (
        lambda tmp: training(run_clock("phones", "trace", tmp, deadline=80.0, stragglers="partial")),
        (12, "cafc7b5349e8ec04")),
    "training, phones, diurnal, poisson": (
        lambda tmp: training(run_clock("phones", "diurnal", tmp, poisson=True), poisson=True),
        (12, "55a509ab55a5faca")),
}
"""Each configuration's plan, and its rounds and hash as first written. Between them: dropouts, stragglers lost and
given up (markov with a deadline), partial stragglers, over-commitment's cut, rounds that wait for a client to come
online, a closed form's long tail (a day's diurnal cycle), and Poisson rounds."""


@pytest.mark.parametrize("configuration", PINNED)
def test_the_clocks_events_are_those_pinned(configuration, tmp_path):
    plan, expected = PINNED[configuration]
    assert hashed(plan(tmp_path)) == expected
