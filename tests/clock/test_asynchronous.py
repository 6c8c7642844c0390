"""FedBuff's and FedAsync's events against a plain event loop written out here: who trains from which version, which
updates each server step takes, and when; and the run clock's results of those steps (their staleness histograms in
rounds.parquet's rows, the metrics rows' staleness and server steps) against the same loop."""

import math

import numpy as np
import pytest

from fedray.clock.asynchronous import AsynchronousRounds, plan_async, staleness_weights
from fedray.clock.costs import TaskCost
from fedray.clock.devices import Devices
from fedray.clock.rounds import SynchronousRounds
from fedray.clock.run_clock import RunClock
from fedray.clock.selector import ClientHistory, RoundContext, UniformSelector
from fedray.clock.streams import uniforms
from fedray.clock.traces import TraceAvailability
from fedray.core.errors import FedrayError
from fedray.core.results import rounds_schema

SEED = 3
CLIENTS = 12
RATES = [1.0, 2.0, 3.0, 1.0, 5.0, 2.5, 4.0, 1.5, 2.0, 3.5, 0.5, 6.0]
"""Each client's compute rate (multiply-adds a second): a task of 6 multiply-adds takes 6 / rate seconds."""
MACS = 6.0
TRACES = {"a": [(0, 10), (20, 25), (40, 60)], "b": [(5, 15), (30, 31)], "c": [(0, 60)], "d": [(0, 4), (10, 20)]}
SPAN = 60.0


@pytest.fixture
def devices(tmp_path):
    path = tmp_path / "devices.csv"
    path.write_text("client_id,macs_per_s,down_bps,up_bps\n"
                    + "".join(f"{client},{rate},1e30,1e30\n" for client, rate in enumerate(RATES)))
    return Devices(str(path))


@pytest.fixture
def traces(tmp_path):
    path = tmp_path / "traces.csv"
    path.write_text("trace_id,start_s,end_s\n" + "".join(f"{name},{start},{end}\n" for name, intervals in TRACES.items()
                                                         for start, end in intervals))
    return TraceAvailability(str(path), seed=SEED)


def windows(client: int, repetitions: int = 20) -> list[tuple[float, float]]:
    """The client's online intervals: its trace (⌊u · 4⌋ of the sorted ids, u from (seed, 44, client)) repeated, the
    intervals that touch joined."""
    name = sorted(TRACES)[min(int(uniforms(SEED, 44, np.array([client]))[0] * 4), 3)]
    joined: list[tuple[float, float]] = []
    for repetition in range(repetitions):
        for start, end in TRACES[name]:
            start, end = repetition * SPAN + start, repetition * SPAN + end
            if joined and joined[-1][1] == start:
                joined[-1] = (joined[-1][0], end)
            else:
                joined.append((start, end))
    return joined


def reference(steps, concurrency, buffer, max_staleness=None, online=None):
    """The module's rules, one event at a time: the lowest-id idle online clients fill the free slots; arrivals at one
    time in client-id order, then the refills; a client offline before it finishes is lost when it goes offline.
    Returns each step's (time, clients, versions)."""
    duration = [MACS / rate for rate in RATES]

    def online_at(client, t):
        return online is None or any(start <= t < end for start, end in online[client])

    def online_until(client, t):
        return math.inf if online is None else next(end for start, end in online[client] if start <= t < end)

    training, steps_taken, buffered, version, now = {}, [], [], 0, 0.0

    def refill(t):
        idle = [client for client in range(CLIENTS) if client not in training and online_at(client, t)]
        for client in idle[:concurrency - len(training)]:
            end = t + duration[client]
            lost = online_until(client, t) < end
            training[client] = (version, online_until(client, t) if lost else end, not lost)

    refill(0.0)
    while len(steps_taken) < steps:
        times = [end for _, end, _ in training.values()]
        if len(training) < concurrency and online is not None:
            times += [start for client in range(CLIENTS) if client not in training
                      for start, _ in online[client] if start > now]
        now = min(times)
        for client in sorted(client for client, (_, end, _) in training.items() if end == now):
            downloaded, _, arrives = training.pop(client)
            if not arrives or (max_staleness is not None and version - downloaded > max_staleness):
                continue
            buffered.append((client, downloaded))
            if len(buffered) == buffer:
                version += 1
                steps_taken.append((now, [c for c, _ in buffered], [v for _, v in buffered]))
                buffered = []
                if len(steps_taken) == steps:
                    return steps_taken
        refill(now)
    return steps_taken


def lowest_ids(availability):
    def pick(wave, t, count, busy):
        idle = np.flatnonzero(~busy)
        if availability is not None:
            idle = idle[availability.available(idle, t)]
        return idle[:count]
    return pick


def planned(devices, steps, concurrency, buffer, max_staleness=None, availability=None):
    plan = plan_async(steps, concurrency, buffer, max_staleness, lowest_ids(availability),
                      lambda clients: TaskCost(MACS, 0.0, 0.0), devices, availability, CLIENTS, SEED)
    return [(a.end_s, a.clients.tolist(), a.versions.tolist()) for a in plan.aggregations], plan


@pytest.mark.parametrize("concurrency, buffer, max_staleness", [(4, 2, None), (6, 3, 1), (5, 1, None), (12, 4, 0)])
def test_fedbuff_s_events_are_the_plain_event_loop_s(devices, concurrency, buffer, max_staleness):
    ours, _ = planned(devices, 15, concurrency, buffer, max_staleness)
    assert ours == reference(15, concurrency, buffer, max_staleness)


@pytest.mark.parametrize("concurrency, buffer", [(4, 2), (6, 1), (3, 3)])
def test_with_availability_clients_come_and_go_as_the_plain_loop_says(devices, traces, concurrency, buffer):
    ours, _ = planned(devices, 12, concurrency, buffer, None, traces)
    assert ours == reference(12, concurrency, buffer, None, {client: windows(client) for client in range(CLIENTS)})


def test_a_buffer_equal_to_the_concurrency_on_equal_devices_is_synchronous_rounds(tmp_path):
    path = tmp_path / "same.csv"
    path.write_text("macs_per_s,down_bps,up_bps,share\n2.0,8e6,8e6,1\n")
    plan = plan_async(5, 4, 4, None, lowest_ids(None), lambda clients: TaskCost(MACS, 1e6, 1e6), Devices(str(path)),
                      None, CLIENTS, SEED)
    assert [a.end_s for a in plan.aggregations] == [5.0, 10.0, 15.0, 20.0, 25.0]  # 3 s compute + 1 s down + 1 s up
    assert all((a.staleness == 0).all() and len(a.dispatched) == 4 for a in plan.aggregations)
    groups = plan.trained_from()
    assert [list(group) for group in groups] == [[1], [2], [3], [4], [5]]  # version v's clients make step v + 1


def test_each_version_s_trainees_are_grouped_by_the_step_that_takes_them(devices):
    _, plan = planned(devices, 10, 6, 2)
    groups = plan.trained_from()
    for version, group in enumerate(groups):
        for number, clients in group.items():
            aggregation = plan.aggregations[number - 1]
            mine = aggregation.versions == version
            assert number > version
            assert clients.tolist() == aggregation.clients[mine][np.argsort(aggregation.dispatches[mine])].tolist()
    assert sum(len(c) for group in groups for c in group.values()) == sum(len(a.clients) for a in plan.aggregations)


@pytest.mark.parametrize("online", [False, True])
def test_the_clock_s_picks_are_the_plain_picks_over_the_training_clients_ids(devices, traces, online):
    """The clock looks each candidate up in a mask of the clients training; the plain pick passes over their ids:
    the schedule's row's idle online clients in order, then uniform draws among the idle online ones (a tight
    availability, so that draws meet busy and offline clients and some waves find too few)."""
    availability = traces if online else None
    schedule = [np.array(row) for row in ([3, 0, 7, 11, 5, 2], [4, 9, 3, 1], [8, 6, 10, 2, 0], [1, 2])]
    costs = lambda clients: TaskCost(MACS * (1.0 + clients % 3), 0.0, 0.0)  # noqa: E731

    def plain_pick(wave, t, count, busy):
        training = np.flatnonzero(busy)
        row = schedule[wave - 1] if wave <= len(schedule) else np.empty(0, dtype=np.int64)
        context = RoundContext(wave, t, 6, count, CLIENTS, SEED, row, ClientHistory(CLIENTS), availability)
        kept = row[context.online(row) & ~np.isin(row, training)][:count]
        return np.concatenate((kept, context.draw_online(count - len(kept), np.concatenate((kept, training)))))

    clock = RunClock(devices, availability, SynchronousRounds(), UniformSelector(), "uniform", CLIENTS, 6, SEED,
                     asynchronous=AsynchronousRounds("fedbuff", concurrency=6, buffer=2))
    ours, _ = clock.asynchronous_steps(20, schedule, costs, 0, "train")
    plain = plan_async(20, 6, 2, None, plain_pick, costs, devices, availability, CLIENTS, SEED)
    fields = ("end_s", "clients", "versions", "dispatches", "dispatched", "dropped", "bytes_down")
    assert [[np.asarray(getattr(a, name)).tolist() for name in fields] for a in ours.aggregations] == \
        [[np.asarray(getattr(a, name)).tolist() for name in fields] for a in plain.aggregations]


def test_staleness_functions_are_the_papers():
    s = np.arange(6)
    assert staleness_weights("constant")(s).tolist() == [1.0] * 6
    assert staleness_weights("sqrt")(s).tolist() == [1 / math.sqrt(1 + x) for x in range(6)]
    assert staleness_weights("poly:0.5")(s).tolist() == [(1 + x) ** -0.5 for x in range(6)]
    assert staleness_weights("hinge:10,2")(s).tolist() == [1.0, 1.0, 1.0, 1 / 11, 1 / 21, 1 / 31]


def clocked_steps(devices, steps, buffer, max_staleness=None, availability=None):
    """``steps`` FedBuff steps of the run's clock with every client training at once (each idle online client is
    dispatched, whatever the pick's order: the plain loop's events)."""
    scheduler = AsynchronousRounds("fedbuff", concurrency=CLIENTS, buffer=buffer, max_staleness=max_staleness)
    clock = RunClock(devices, availability, SynchronousRounds(), UniformSelector(), "uniform", CLIENTS, CLIENTS, SEED,
                     asynchronous=scheduler)
    _, records = clock.asynchronous_steps(steps, [], lambda clients: TaskCost(MACS, 0.0, 0.0), 0, "train")
    return clock, records


@pytest.mark.parametrize("buffer, max_staleness, online", [(5, None, False), (3, 1, False), (4, None, True)])
def test_each_step_s_staleness_histogram_and_the_rows_staleness_are_the_plain_event_loop_s(devices, traces, buffer,
                                                                                          max_staleness, online):
    steps, rows = 15, [4, 9, 15]
    expected = reference(steps, CLIENTS, buffer, max_staleness,
                         {client: windows(client) for client in range(CLIENTS)} if online else None)
    clock, records = clocked_steps(devices, steps, buffer, max_staleness, traces if online else None)
    staleness = [[number - 1 - version for version in versions]
                 for number, (_, _, versions) in enumerate(expected, start=1)]
    assert max(max(step) for step in staleness) >= 1
    assert [(record.end_s, record.clients.tolist()) for record in records] == [(end, c) for end, c, _ in expected]
    table = clock.table()
    assert table.num_rows == steps and table.schema == rounds_schema(asynchronous=True)
    for row, ages in zip(table.to_pylist(), staleness):
        assert row["staleness_counts"] == [ages.count(s) for s in range(max(ages) + 1)]
        assert sum(row["staleness_counts"]) == row["finished"] == buffer
    assert clock.columns(0) == {"clock_s": 0.0, "clock_compute_s": 0.0, "clock_comm_s": 0.0, "clients_straggled": 0,
                                "clients_dropped": 0, "aggregations": 0}  # no update yet: no staleness
    previous = 0
    for row in rows:
        window = [age for ages in staleness[previous:row] for age in ages]
        columns = clock.columns(row, previous)
        assert (columns["aggregations"], columns["clock_s"]) == (row, expected[row - 1][0])
        assert (columns["staleness_mean"], columns["staleness_max"]) == (sum(window) / len(window), max(window))
        previous = row
    whole = [age for ages in staleness for age in ages]
    assert (clock.columns(steps)["staleness_mean"], clock.columns(steps)["staleness_max"]) == \
        (sum(whole) / len(whole), max(whole))  # no row before: from the start


@pytest.mark.parametrize("options, message", [
    ({"scheduler": "fedbuff", "concurrency": 2, "buffer": 3}, "--buffer 3 is more than --concurrency 2"),
    ({"scheduler": "fedbuff", "max_staleness": -1}, "--max-staleness must be ≥ 0"),
    ({"scheduler": "fedasync", "mixing": 1.5}, "--mixing must be in (0, 1]"),
    ({"scheduler": "fedasync", "mixing": 0.0}, "--mixing must be in (0, 1]"),
    ({"scheduler": "fedbuff", "staleness": "poly:-1"}, "must not grow with staleness"),
    ({"scheduler": "fedbuff", "staleness": "hinge:1"}, "--staleness must be constant|sqrt|poly:A|hinge:A,B"),
    ({"scheduler": "fedasync", "buffer": 4}, "--scheduler fedasync steps on every update"),
    ({"scheduler": "later"}, "--scheduler must be sync|fedbuff|fedasync"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(FedrayError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        AsynchronousRounds(**options)


def test_a_run_nobody_can_ever_join_is_refused(devices):
    class GoneAfterOne:  # online in [0, 1) only, never again
        def available(self, clients, t):
            return np.full(len(clients), t < 1.0)

        def online_until(self, clients, t):
            return np.full(len(clients), 1.0)

        def next_available(self, clients, t):
            return np.full(len(clients), t if t < 1.0 else math.inf)

    with pytest.raises(FedrayError, match="no client will ever come online"):
        planned(devices, 3, 2, 1, None, GoneAfterOne())
