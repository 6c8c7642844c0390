import numpy as np
import pytest

from fedray.clock.availability import AlwaysAvailable
from fedray.clock.diurnal import DiurnalAvailability
from fedray.core.errors import FedrayError


def test_always_keeps_every_client_online_for_ever():
    model = AlwaysAvailable()
    clients = np.array([0, 5, 10**6])
    times = np.array([0.0, 3.5, 1e12])
    assert model.available(clients, times).tolist() == [True, True, True]
    assert model.next_available(clients, times).tolist() == times.tolist()
    assert model.online_until(clients, times).tolist() == [np.inf] * 3
    assert model.stays_available(clients, times, times + 1e9).tolist() == [True, True, True]


def test_a_round_needs_as_many_clients_as_it_draws():
    AlwaysAvailable().check_rounds_can_fill(10, 10)
    with pytest.raises(FedrayError, match="a round of 11 clients cannot fill from a population of 10"):
        AlwaysAvailable().check_rounds_can_fill(11, 10)
    with pytest.raises(FedrayError, match="a round of 0 clients cannot fill"):
        AlwaysAvailable().check_rounds_can_fill(0, 10)


def test_one_time_or_one_per_client():
    model = DiurnalAvailability(diurnal_period_s=10.0, diurnal_duty=0.5, seed=1)
    clients = np.arange(20)
    one = model.online_until(clients, 4.0)
    each = model.online_until(clients, np.full(20, 4.0))
    assert one.tolist() == each.tolist()
    assert model.available(np.array([], dtype=np.int64), 1.0).tolist() == []


def test_stays_available_is_online_until_at_least_t1():
    model = DiurnalAvailability(diurnal_period_s=10.0, diurnal_duty=0.5, seed=1)
    clients = np.arange(30)
    until = model.online_until(clients, 2.0)
    online = model.available(clients, 2.0)
    assert 0 < online.sum() < 30
    assert model.stays_available(clients, 2.0, 2.0).tolist() == online.tolist()
    assert model.stays_available(clients, 2.0, np.maximum(until, 2.0)).tolist() == online.tolist()
    assert not model.stays_available(clients, 2.0, np.nextafter(np.maximum(until, 2.0), np.inf)).any()


@pytest.mark.parametrize("clients, times, message", [
    (np.array([[1, 2]]), 0.0, "available: clients must be a 1-d array of integer ids, got int64 of shape .1, 2."),
    (np.array([0.5]), 0.0, "available: clients must be a 1-d array of integer ids, got float64"),
    (np.array([-1, 2]), 0.0, "available: client ids must be ≥ 0, got -1"),
    (np.array([1, 2]), -1.0, "available: times must be finite virtual seconds ≥ 0"),
    (np.array([1, 2]), np.nan, "available: times must be finite virtual seconds ≥ 0"),
    (np.array([1, 2]), np.zeros(3), r"available: times must be one number or one per client \(2\), got shape \(3,\)"),
])
def test_bad_lookups_are_refused(clients, times, message):
    with pytest.raises(FedrayError, match=message):
        AlwaysAvailable().available(clients, times)


def test_an_interval_that_ends_before_it_starts_is_refused():
    with pytest.raises(FedrayError, match=r"stays_available: an interval \[t0, t1\) ends before it starts"):
        AlwaysAvailable().stays_available(np.array([1, 2]), 5.0, np.array([6.0, 4.0]))
