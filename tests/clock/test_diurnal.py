import numpy as np
import pytest

from fedray.clock.diurnal import DiurnalAvailability
from fedray.clock.streams import uniforms
from fedray.core.errors import FedrayError

PERIOD, DUTY, SEED = 100.0, 0.3, 7
CLIENTS = np.arange(50)


def reference(phase: float, t: float) -> tuple[bool, float, float]:
    """(available, next_available, online_until) at t from the intervals [(n − phase)·P, (n − phase)·P + DUTY·P)
    listed one by one."""
    intervals = [((n - phase) * PERIOD, (n - phase) * PERIOD + DUTY * PERIOD) for n in range(-1, 40)]
    for start, end in intervals:
        if start <= t < end:
            return True, t, end
    return False, min(start for start, _ in intervals if start > t), t


def moments(phase: float) -> list[float]:
    """Times to look at: every interval edge exactly, a rounding either side of it, and times in between."""
    edges = [(n - phase) * PERIOD + offset for n in range(0, 12) for offset in (0.0, DUTY * PERIOD)]
    edges = [edge for edge in edges if edge > 0]
    return [0.0, 0.5, 1234.5, *edges, *np.nextafter(edges, np.inf), *np.nextafter(edges, -np.inf)]


def test_lookups_match_the_intervals_listed_one_by_one():
    model = DiurnalAvailability(diurnal_period_s=PERIOD, diurnal_duty=DUTY, seed=SEED)
    for client in CLIENTS:
        phase = uniforms(SEED, 43, np.array([client]))[0]
        times = np.array(moments(phase))
        ids = np.full(times.size, client)
        expected = [reference(phase, t) for t in times]
        assert model.available(ids, times).tolist() == [online for online, _, _ in expected]
        assert model.next_available(ids, times).tolist() == [moment for _, moment, _ in expected]
        assert model.online_until(ids, times).tolist() == [until for _, _, until in expected]


def test_the_formula_of_the_pattern_holds_away_from_the_edges():
    model = DiurnalAvailability(diurnal_period_s=PERIOD, diurnal_duty=DUTY, seed=SEED)
    times = np.random.default_rng(0).uniform(0, 50 * PERIOD, size=2000)
    clients = np.random.default_rng(1).integers(0, 50, size=2000)
    position = np.mod(times / PERIOD + uniforms(SEED, 43, clients), 1.0)
    clear = (np.abs(position - DUTY) > 1e-9) & (position > 1e-9) & (position < 1 - 1e-9)
    assert np.array_equal(model.available(clients, times)[clear], (position < DUTY)[clear])


def test_intervals_are_half_open():
    model = DiurnalAvailability(diurnal_period_s=PERIOD, diurnal_duty=DUTY, seed=SEED)
    client = np.array([3])
    start = model.next_available(client, 150.0)
    end = start + DUTY * PERIOD
    assert model.available(client, start).tolist() == [True]
    assert model.available(client, end).tolist() == [False]
    assert model.online_until(client, start).tolist() == end.tolist()
    assert model.stays_available(client, start, end).tolist() == [True]
    assert model.stays_available(client, start, np.nextafter(end, np.inf)).tolist() == [False]


def test_the_most_clients_online_at_once_decides_whether_rounds_fill():
    model = DiurnalAvailability(diurnal_period_s=PERIOD, diurnal_duty=DUTY, seed=SEED)
    phases = uniforms(SEED, 43, CLIENTS).tolist()
    # the most phases in one arc [w, w + DUTY) of the circle, w at each phase in turn
    most = max(sum((other - phase) % 1.0 < DUTY for other in phases) for phase in phases)
    assert 15 <= most < 40  # neither every client nor the expected 15: the arc test means something
    model.check_rounds_can_fill(most, CLIENTS.size)
    with pytest.raises(FedrayError, match=f"at most {most} of the 50 clients online at once: a round of {most + 1}"):
        model.check_rounds_can_fill(most + 1, CLIENTS.size)


def test_the_lookups_after_the_check_read_the_phases_it_drew_the_same_numbers():
    model = DiurnalAvailability(diurnal_period_s=PERIOD, diurnal_duty=DUTY, seed=SEED)
    model.check_rounds_can_fill(1, 30)  # keeps the phases of clients 0..29
    fresh = DiurnalAvailability(diurnal_period_s=PERIOD, diurnal_duty=DUTY, seed=SEED)
    clients = np.array([29, 3, 41, 0, 3])  # 41 is beyond the kept phases: drawn
    assert model.phases(clients).tolist() == uniforms(SEED, 43, clients).tolist()
    t = np.linspace(0.0, 3 * PERIOD, len(clients))
    for lookup in ("available", "next_available", "online_until"):
        assert getattr(model, lookup)(clients, t).tolist() == getattr(fresh, lookup)(clients, t).tolist()


def test_the_phases_are_kept_inside_a_hearing_loop_only_and_lookups_give_the_same_numbers():
    """The check keeps every client's phases; a hearing loop (:meth:`population_kept`) keeps them (drawing them where
    the check has not) and lets them go when it ends: the lookups after hash the clients they ask about, the same
    numbers."""
    model = DiurnalAvailability(diurnal_period_s=PERIOD, diurnal_duty=DUTY, seed=SEED)
    clients, t = np.array([29, 3, 0]), np.array([10.0, PERIOD / 3, 2 * PERIOD])
    before = {lookup: getattr(model, lookup)(clients, t).tolist() for lookup in ("available", "next_available")}
    for check in (True, False):
        if check:
            model.check_rounds_can_fill(1, 30)
        with model.population_kept(30):
            assert model._population_phases.tolist() == uniforms(SEED, 43, np.arange(30)).tolist()
            assert {lookup: getattr(model, lookup)(clients, t).tolist() for lookup in before} == before
        assert model._population_phases is None
        assert {lookup: getattr(model, lookup)(clients, t).tolist() for lookup in before} == before


@pytest.mark.parametrize("options, message", [
    ({"diurnal_duty": 0.0}, r"--diurnal-duty must be in \(0, 1\)"),
    ({"diurnal_duty": 1.0}, r"--diurnal-duty must be in \(0, 1\) \(1 is --availability always\)"),
    ({"diurnal_period_s": 0.0}, "--diurnal-period-s must be > 0"),
    ({"diurnal_period_s": -5.0}, "--diurnal-period-s must be > 0"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(FedrayError, match=message):
        DiurnalAvailability(**options)
