"""Whom a closed form still has to hear: the schedule's clients, less those heard and those given up; a row asks its
clients less those heard in another round's place, and keeps the schedule's own repeats."""

import numpy as np

from fedray.clock.availability import Availability
from fedray.clock.diurnal import DiurnalAvailability
from fedray.clock.hearing import MAX_LOST, StillToHear


class Windows(Availability):
    """Client c is online during [10c, 10c + 5) only; the clients looked up are counted."""

    def __init__(self) -> None:
        self.looked_up = 0

    def _available(self, clients, t):
        self.looked_up += len(clients)
        return (10 * clients <= t) & (t < 10 * clients + 5)

    def _next_online(self, clients, t):
        return np.where(t < 10 * clients, 10.0 * clients, np.inf)

    def _online_end(self, clients, t):
        return 10.0 * clients + 5


def test_the_clients_to_hear_are_the_schedules_less_those_heard_and_given_up():
    hearing = StillToHear.of([np.array([4, 1]), np.array([1, 6])], 8)
    assert np.flatnonzero(hearing.eligible).tolist() == [1, 4, 6] and hearing.remaining == 3
    hearing.hear(np.array([4, 0]), np.array([6]))  # 0 is not the schedule's: heard, never to hear
    assert np.flatnonzero(hearing.eligible).tolist() == [1, 6] and hearing.remaining == 2
    assert hearing.lost.tolist() == [0, 0, 0, 0, 0, 0, 1, 0]
    for _ in range(MAX_LOST - 2):
        hearing.hear(np.zeros(0, dtype=np.int64), np.array([6]))
    assert hearing.eligible[6] and hearing.given_up == 0
    hearing.hear(np.zeros(0, dtype=np.int64), np.array([6, 4]))  # 4 was heard: its loss does not count
    assert np.flatnonzero(hearing.eligible).tolist() == [1]
    assert (hearing.remaining, hearing.given_up, hearing.lost[4]) == (1, 1, 0)


def test_a_row_asks_its_clients_less_those_heard_in_another_rounds_place_but_keeps_the_schedules_repeats():
    hearing = StillToHear.of([np.array([0, 1]), np.array([2, 3]), np.array([3, 0])], 4)
    assert hearing.row(np.array([0, 1])).tolist() == [0, 1]
    hearing.hear(np.array([0, 3]), np.zeros(0, dtype=np.int64))  # 3 filled 1's place (1 offline)
    assert hearing.row(np.array([2, 3])).tolist() == [2]  # 3 was heard in 1's place
    hearing.hear(np.array([2]), np.zeros(0, dtype=np.int64))
    assert hearing.row(np.array([3, 0])).tolist() == [3, 0]  # the schedule asks both again: as without a clock
    assert np.flatnonzero(hearing.eligible).tolist() == [1]


def test_who_is_online_looks_up_only_the_clients_still_to_hear_that_may_be_online():
    availability = Windows()
    hearing = StillToHear(4, np.ones(4, dtype=bool), availability)
    assert hearing.online(0.0).tolist() == [0] and availability.looked_up == 4
    assert hearing.online(3.0).tolist() == [0] and availability.looked_up == 5  # 1, 2, 3 are offline until 10, 20, 30
    assert hearing.next_online(6.0) == 10.0 and availability.looked_up == 6  # client 0 went offline at 5, for good
    hearing.hear(np.array([1]), np.zeros(0, dtype=np.int64))
    assert hearing.next_online(12.0) == 20.0 and availability.looked_up == 6  # 0 never again, 1 heard: none looked up
    assert hearing.online(21.0).tolist() == [2] and availability.looked_up == 7
    assert hearing.found == 1


def test_the_clients_online_and_the_next_to_come_online_agree_with_a_lookup_of_every_client_still_to_hear():
    """200 clients online 30 % of every 10 s, asked at increasing moments while some are heard and others lost: who
    is online and when the next comes online, against every client still to hear looked up afresh."""
    availability = DiurnalAvailability(diurnal_period_s=10.0, diurnal_duty=0.3, seed=7)
    target = np.zeros(200, dtype=bool)
    target[::3] = target[1::3] = True
    hearing = StillToHear(200, target, availability)
    draws = np.random.default_rng(0)
    t, found = 0.0, []
    while hearing.remaining:
        t += float(draws.exponential(0.4))
        to_hear = np.flatnonzero(hearing.eligible)
        online = to_hear[availability.available(to_hear, t)]
        assert hearing.online(t).tolist() == online.tolist() and hearing.found == len(online)
        expected = float(availability.next_available(to_hear, t).min(initial=np.inf))
        assert hearing.next_online(t) == expected
        hearing.hear(online[::2], online[1::2])  # half heard, half lost
        found.append(len(online))
    assert 0 in found and max(found) > 10


def test_whether_a_client_found_online_before_still_is_asks_only_those_and_changes_nothing():
    availability = Windows()
    hearing = StillToHear(4, np.ones(4, dtype=bool), availability)
    assert not hearing.surely_online(0.0) and availability.looked_up == 0  # nobody found online yet
    assert hearing.online(0.0).tolist() == [0] and availability.looked_up == 4
    assert hearing.surely_online(3.0) and availability.looked_up == 5 and hearing.found == 1
    assert not hearing.surely_online(6.0) and availability.looked_up == 6  # client 0 went offline at 5
    hearing.hear(np.array([0]), np.zeros(0, dtype=np.int64))
    assert not hearing.surely_online(3.0) and availability.looked_up == 6  # heard: not looked up
    assert hearing.next_online(6.0) == 10.0


def test_the_calendar_gives_what_a_plain_list_of_entries_gives():
    """Random additions, takings and first moments among the eligible, against a plain list of (moment, client)."""
    from fedray.clock.hearing import _Calendar

    rng = np.random.default_rng(7)
    calendar, entries = _Calendar(), []
    eligible = np.ones(5000, dtype=bool)
    t = 0.0
    for step in range(300):
        count = int(rng.integers(0, 3000 if step == 0 else 60))
        moments = t + np.round(rng.exponential(50.0, count), 1)  # ties among moments too
        clients = rng.choice(5000, count, replace=False)
        calendar.add(moments, clients)
        entries += list(zip(moments.tolist(), clients.tolist()))
        eligible[rng.choice(5000, 20, replace=False)] = False
        first = min((moment for moment, client in entries if eligible[client]), default=np.inf)
        assert calendar.first(eligible) == first
        t += float(rng.exponential(20.0))
        due = sorted(client for moment, client in entries if moment <= t)
        entries = [(moment, client) for moment, client in entries if moment > t]
        taken = calendar.due(t)
        assert sorted(taken[eligible[taken]].tolist()) == [client for client in due if eligible[client]]
    assert len(calendar._runs) <= 12
