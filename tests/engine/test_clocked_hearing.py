"""A closed form's rounds on the clock by hand (its hearing, in fedray/engine/clocked.py): a round draws only clients
not heard yet, waits for one to come online, asks a dropout again, and the stage goes on after its schedule until every
client was heard."""

import numpy as np
import pytest

from fedray.clock.costs import TaskCost
from fedray.clock.devices import Devices
from fedray.clock.diurnal import DiurnalAvailability
from fedray.clock.hearing import MAX_LOST
from fedray.clock.rounds import SynchronousRounds
from fedray.clock.run_clock import RunClock
from fedray.clock.selector import Selector, UniformSelector
from fedray.clock.traces import TraceAvailability
from fedray.core.errors import FedrayError
from fedray.engine.clocked import ClosedFormTasks, clocked_closed_form

# One device per client; a closed form's task of 100 multiply-adds and 100 bytes up takes 100 / macs_per_s seconds
# of compute and 800 / up_bps of upload:
#   client 0: 1 + 1 = 2 s   client 1: 2 + 1 = 3 s   client 2: 4 + 1 = 5 s
#   client 3: 1 + 10 = 11 s client 4: 10 + 1 = 11 s client 5: 1 + 1 = 2 s
DEVICES = """client_id,macs_per_s,down_bps,up_bps
0,100,800,800
1,50,800,800
2,25,800,800
3,100,80,80
4,10,800,800
5,100,800,800
"""
TASKS = ClosedFormTasks(np.full(6, 100.0), np.full(6, 100.0), 25)
SEED = 157
"""A seed whose draw gives each of the six clients a trace of its own: client c follows trace FOLLOWS[c]."""
FOLLOWS = [5, 3, 4, 1, 0, 2]
ONLINE = {0: [(0, 100)], 1: [(0, 100)], 2: [(20, 100)], 3: [(0, 10), (30, 100)], 4: [(40, 100)], 5: [(50, 60)]}
"""Each client's online intervals (seconds) over the traces' span of 100 s."""


def clock(tmp_path, online=ONLINE, selector: Selector = UniformSelector(), name: str = "uniform",
          **rounds) -> RunClock:
    devices = tmp_path / "devices.csv"
    devices.write_text(DEVICES)
    traces = tmp_path / "traces.csv"
    traces.write_text("trace_id,start_s,end_s\n" + "".join(
        f"{FOLLOWS[client]},{start},{end}\n" for client, intervals in online.items() for start, end in intervals))
    availability = TraceAvailability(str(traces), seed=SEED)
    assert availability.trace_of(np.arange(6)).tolist() == FOLLOWS
    return RunClock(Devices(str(devices)), availability, SynchronousRounds(**rounds), selector, name, 6, 2,
                    seed=SEED)


def rounds_of(records) -> list[tuple]:
    return [(record.number, record.start_s, record.end_s, record.selected.tolist(), record.clients.tolist(),
             record.dropped) for record in records]


def test_a_closed_form_waits_for_clients_not_heard_yet_asks_a_dropout_again_and_hears_everyone(tmp_path):
    records = clocked_closed_form(clock(tmp_path), [np.array([0, 1]), np.array([2, 3]), np.array([4, 5])], TASKS,
                                  "closed_form")
    assert rounds_of(records) == [
        (1, 0.0, 3.0, [0, 1], [0, 1], 0),
        # client 2 is offline until 20 and nobody online is still to hear (0 and 1 were heard): client 3 alone, whose
        # 11 s would end at 14, but it goes offline at 10: it drops out, the server waiting for it until 14
        (2, 3.0, 14.0, [3], [], 1),
        # 4 and 5 offline, none of 2, 3 online at 14: the round starts when client 2 comes online, at 20
        (3, 20.0, 25.0, [2], [2], 0),
        # after the schedule's rounds: client 3 again when it is back, at 30, then 4 (at 40) and 5 (at 50)
        (4, 30.0, 41.0, [3], [3], 0),
        (5, 41.0, 52.0, [4], [4], 0),
        (6, 52.0, 54.0, [5], [5], 0),
    ]
    assert [record.lost.tolist() for record in records] == [[], [3], [], [], [], []]


def test_a_client_heard_in_another_rounds_place_leaves_its_own_to_one_not_heard_yet(tmp_path):
    """Client 5 fills client 2's place in round 2 (2 is offline until 20); in round 3 its own place is not asked
    again but filled by 2, once online, and 4 is heard after the schedule, when it comes online at 40."""
    online = {**ONLINE, 3: [(0, 100)], 5: [(0, 100)]}
    records = clocked_closed_form(clock(tmp_path, online), [np.array([0, 1]), np.array([2, 3]), np.array([5, 4])],
                                  TASKS, "closed_form")
    assert rounds_of(records) == [
        (1, 0.0, 3.0, [0, 1], [0, 1], 0),
        (2, 3.0, 14.0, [3, 5], [3, 5], 0),  # 2 offline: the only other client online not heard yet is 5
        (3, 20.0, 25.0, [2], [2], 0),  # row [5, 4] asks 4 only, offline: the round waits for 2, and 2 fills
        (4, 40.0, 51.0, [4], [4], 0),
    ]


def test_a_client_whose_uploads_are_lost_max_lost_times_is_given_up(tmp_path):
    """Client 3 is online 10 s of every 100 and its task takes 11 s: it drops out each time it is asked."""
    online = {**ONLINE, 3: [(0, 10)]}
    records = clocked_closed_form(clock(tmp_path, online), [np.array([0, 1]), np.array([2, 3]), np.array([4, 5])],
                                  TASKS, "closed_form")
    asked = [record for record in records if 3 in record.selected]
    assert len(asked) == MAX_LOST and all(record.lost.tolist() == [3] for record in asked)
    assert [record.start_s for record in asked[1:]] == [100.0 * turn for turn in range(1, MAX_LOST)]
    heard = np.concatenate([record.clients for record in records])
    assert sorted(heard.tolist()) == [0, 1, 2, 4, 5] and records[-1] is asked[-1]


class Repeating(Selector):
    """Asks client 0 (heard in round 1) every round."""

    def select(self, context):
        return np.array([0])


def test_a_selector_that_asks_none_of_the_clients_still_to_hear_after_the_schedule_is_refused(tmp_path):
    with pytest.raises(FedrayError, match=r"^selector repeating.py:Repeating asked none of the clients the closed_form "
                                          r"stage still has to hear \(5\) in round 4: it would never end$"):
        clocked_closed_form(clock(tmp_path, selector=Repeating(), name="repeating.py:Repeating"),
                            [np.array([0, 1]), np.array([2, 3]), np.array([4, 5])], TASKS, "closed_form")


class FirstOnline(Selector):
    """The round's scheduled clients online at its start, then the lowest ids of those it still has to hear that are
    online (the hearing's own list of them)."""

    def select(self, context):
        kept = context.scheduled[context.online(context.scheduled)][: context.wanted]
        fill = context.eligible_online()
        fill = fill[~np.isin(fill, kept)]
        return np.concatenate((kept, fill[: context.wanted - len(kept)]))


def test_the_tail_of_a_closed_form_under_diurnal_availability_is_a_plain_loop_over_the_clients_still_to_hear():
    """40 phones online 30 % of every 20 s, tasks of about 1 to 20 s: after the schedule's 10 rounds the stage hears the
    rest a few at a time, rounds waiting for a client still to hear to come online and clients dropping out. Each of
    those rounds against a plain loop that looks every client still to hear up at each round's start."""
    num_clients, per_round, seed = 40, 4, 5
    availability = DiurnalAvailability(diurnal_period_s=20.0, diurnal_duty=0.3, seed=seed)
    devices = Devices("phones")
    tasks = ClosedFormTasks(np.full(num_clients, 1e6), 1e6 * (1.0 + np.arange(num_clients) % 7), 25)
    schedule = [np.arange(start, start + per_round) for start in range(0, num_clients, per_round)]
    run = RunClock(devices, availability, SynchronousRounds(), FirstOnline(), "first_online.py:FirstOnline",
                   num_clients, per_round, seed=seed)
    records = clocked_closed_form(run, schedule, tasks, "closed_form")

    scheduled = records[:len(schedule)]
    heard = {int(client) for record in scheduled for client in record.clients}
    lost = {client: sum(client in record.lost for record in scheduled) for client in range(num_clients)}
    to_hear = [client for client in range(num_clients) if client not in heard and lost[client] < MAX_LOST]
    t, number, expected = scheduled[-1].end_s, len(schedule), []
    while to_hear:
        number += 1
        online = [client for client in to_hear if availability.available(np.array([client]), t)[0]]
        if not online:
            t = min(float(availability.next_available(np.array([client]), t)[0]) for client in to_hear)
            online = [client for client in to_hear if availability.available(np.array([client]), t)[0]]
        asked = np.array(online[:per_round], dtype=np.int64)
        durations = devices.durations(asked, number, TaskCost(tasks.macs[asked], 0.0, tasks.up_bytes[asked]), seed)
        finish = t + ((durations.down_s + durations.up_s) + durations.compute_s)
        stays = availability.stays_available(asked, t, finish)
        expected.append((number, t, float(finish.max()), asked.tolist(), asked[stays].tolist()))
        for client in asked[~stays].tolist():
            lost[client] += 1
        to_hear = [client for client in to_hear
                   if client not in asked[stays].tolist() and lost[client] < MAX_LOST]
        t = float(finish.max())
    tail = records[len(schedule):]
    assert [(record.number, record.start_s, record.end_s, record.selected.tolist(), record.clients.tolist())
            for record in tail] == expected
    assert any(later.start_s > earlier.end_s for earlier, later in zip(tail, tail[1:]))  # rounds that waited
    assert any(len(record.lost) for record in tail) and any(len(record.clients) > 1 for record in tail)


class Watched(UniformSelector):
    """The uniform selector, noting the round and start of each round it is asked for."""

    asked: list[tuple[int, float]] = []

    def select(self, context):
        Watched.asked.append((context.round, context.start_s))
        return super().select(context)


def test_a_round_that_waits_for_a_client_to_come_online_asks_the_selector_once_when_it_starts(tmp_path):
    Watched.asked.clear()
    records = clocked_closed_form(clock(tmp_path, selector=Watched()), [np.array([0, 1]), np.array([2, 3]),
                                                                        np.array([4, 5])], TASKS, "closed_form")
    assert [record.start_s for record in records] == [0.0, 3.0, 20.0, 30.0, 41.0, 52.0]  # the first test's rounds
    assert Watched.asked == [(record.number, record.start_s) for record in records]
