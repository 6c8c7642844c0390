"""The run's clock by hand: a round's durations from a device table written out here, over-commitment's choice, the
deadline's stragglers, rounds chained in time, the critical path's split, and evaluation every S virtual seconds."""

import weakref

import numpy as np
import pytest

from fedray.clock.availability import Availability
from fedray.clock.costs import TaskCost
from fedray.clock.devices import Devices
from fedray.clock.rounds import SynchronousRounds
from fedray.clock.run_clock import RunClock, evaluated_rounds
from fedray.clock.selector import UniformSelector
from fedray.core.errors import FedrayError
from fedray.core.results import rounds_schema

# One device per client. A task of 100 multiply-adds, 100 bytes down and 100 up takes 100 / macs_per_s seconds of
# compute and 800 / down_bps + 800 / up_bps of transfers:
#   client 0: 1 + 1 + 1 = 3 s   client 1: 2 + 2 = 4 s   client 2: 4 + 2 = 6 s
#   client 3: 1 + 20 = 21 s     client 4: 10 + 2 = 12 s client 5: 1 + 2 = 3 s
TABLE = """client_id,macs_per_s,down_bps,up_bps
0,100,800,800
1,50,800,800
2,25,800,800
3,100,80,80
4,10,800,800
5,100,800,800
"""
TASK = TaskCost(100.0, 100.0, 100.0)


class OnlineFrom(Availability):
    """Every client offline before ``start_s``, online from then on."""

    def __init__(self, start_s: float) -> None:
        self.start_s = start_s

    def _available(self, clients, t):
        return t >= self.start_s

    def _next_online(self, clients, t):
        return np.full(clients.shape, self.start_s)

    def _online_end(self, clients, t):
        return np.full(clients.shape, np.inf)


def clock(tmp_path, num_clients=6, per_round=3, availability=None, **rounds) -> RunClock:
    table = tmp_path / "devices.csv"
    table.write_text(TABLE)
    return RunClock(Devices(str(table)), availability, SynchronousRounds(**rounds), UniformSelector(), "uniform",
                    num_clients, per_round, seed=7)


def test_a_round_lasts_until_its_slowest_client_and_the_next_starts_then(tmp_path):
    run = clock(tmp_path)
    first = run.round(1, "train", np.array([4, 2, 0]), lambda clients: TASK)
    assert (first.start_s, first.end_s) == (0.0, 12.0)
    assert first.clients.tolist() == [4, 2, 0]  # the schedule's order, not the arrival order
    assert (first.compute_s, first.comm_s) == (10.0, 2.0)  # client 4's compute, then its transfers
    assert (first.stragglers, first.dropped, first.bytes_up, first.bytes_down) == (0, 0, 300.0, 300.0)
    second = run.round(2, "train", np.array([1, 5, 3]), lambda clients: TASK)
    assert (second.start_s, second.end_s) == (12.0, 33.0)  # client 3's 21 s
    assert (second.compute_s, second.comm_s) == (1.0, 20.0)
    assert run.columns(1) == {"clock_s": 12.0, "clock_compute_s": 10.0, "clock_comm_s": 2.0, "clients_straggled": 0,
                              "clients_dropped": 0}
    assert run.columns(2) == {"clock_s": 33.0, "clock_compute_s": 11.0, "clock_comm_s": 22.0, "clients_straggled": 0,
                              "clients_dropped": 0}
    assert run.columns(0)["clock_s"] == 0.0
    assert run.table().schema == rounds_schema()
    assert run.table().to_pylist() == [  # rounds.parquet's rows: every client kept, 100 bytes up and down each
        {"round": 1, "stage": "train", "start_s": 0.0, "end_s": 12.0, "selected": 3, "finished": 3, "stragglers": 0,
         "dropped": 0, "bytes_up": 300.0, "bytes_down": 300.0},
        {"round": 2, "stage": "train", "start_s": 12.0, "end_s": 33.0, "selected": 3, "finished": 3, "stragglers": 0,
         "dropped": 0, "bytes_up": 300.0, "bytes_down": 300.0}]


def test_a_round_with_nobody_online_starts_when_the_first_client_comes_online(tmp_path):
    run = clock(tmp_path, availability=OnlineFrom(10.0))
    record = run.round(1, "train", np.array([4, 2, 0]), lambda clients: TASK)
    assert (record.start_s, record.end_s, record.clients.tolist()) == (10.0, 22.0, [4, 2, 0])
    assert run.columns(1)["clock_s"] == 22.0  # the wait is part of the round: virtual seconds since the run's start


def test_a_deadline_makes_the_late_clients_stragglers_and_keeps_the_others(tmp_path):
    run = clock(tmp_path, deadline=7.0)
    record = run.round(1, "train", np.array([4, 2, 0]), lambda clients: TASK)
    assert record.clients.tolist() == [2, 0]  # 6 s and 3 s; client 4's 12 s miss the 7 s
    assert record.stragglers == 1
    assert record.end_s == 7.0  # the server waits for the deadline: client 4's upload never comes
    assert (record.compute_s, record.comm_s) == (4.0, 3.0)  # client 2 ends the critical path; the wait counts as comm
    assert record.bytes_up == 200.0 and record.bytes_down == 300.0  # two uploads kept; every selected client downloads


def test_over_commitment_asks_more_and_keeps_the_first_kappa_to_finish(tmp_path):
    run = clock(tmp_path, num_clients=3, per_round=2, over_commit=1.5)
    record = run.round(1, "train", np.array([2, 1]), lambda clients: TASK)
    assert record.selected.tolist() == [2, 1, 0]  # ⌈1.5 · 2⌉ = 3: the schedule's two, then the only other client
    assert record.clients.tolist() == [1, 0]  # 4 s and 3 s; client 2 (6 s) is cut, neither straggler nor dropout
    assert (record.end_s, record.stragglers, record.dropped) == (4.0, 0, 0)


def test_a_task_per_client_and_partial_steps(tmp_path):
    run = clock(tmp_path, deadline=7.0, stragglers="partial")
    tasks = {4: TaskCost(100.0, 100.0, 100.0), 2: TaskCost(0.0, 100.0, 100.0)}
    record = run.round(1, "train", np.array([4, 2]),
                       lambda clients: TaskCost(*(np.array([getattr(tasks[c], name) for c in clients.tolist()])
                                                  for name in ("macs", "down_bytes", "up_bytes"))),
                       lambda clients: np.full(len(clients), 10))
    # client 4: 2 s of transfers and 10 steps of 1 s each: 5 steps by the deadline, finishing at 2 + 5 = 7 s
    assert record.clients.tolist() == [4, 2] and record.steps.tolist() == [5, 10]
    assert (record.end_s, record.stragglers, record.compute_s, record.comm_s) == (7.0, 1, 5.0, 2.0)


def test_a_deadline_no_device_meets_is_refused(tmp_path):
    run = clock(tmp_path, deadline=2.5)  # the quickest task is 3 s (100 / 100 + 800 / 800 + 800 / 800)
    with pytest.raises(FedrayError, match=r"^--deadline 2.5: no device can meet it: the quickest client's task takes "
                                          r"3 s"):
        run.check(TaskCost(np.full(6, 100.0), 100.0, 100.0))
    clock(tmp_path, deadline=3.0).check(TaskCost(np.full(6, 100.0), 100.0, 100.0))


def test_evaluation_every_s_seconds_is_the_first_round_ending_at_or_after_each_multiple_and_the_last():
    ends = [4.0, 9.0, 10.0, 11.0, 31.0, 32.0]  # multiples of 10: 10 (round 3), 20 and 30 (round 5)
    assert evaluated_rounds(np.array(ends), 0.0, 10.0) == {3, 5, 6}
    assert evaluated_rounds(np.array(ends), 0.0, 100.0) == {6}
    assert evaluated_rounds(np.array([12.0, 25.0]), 10.0, 10.0) == {2}  # started at 10: the next multiple is 20


def test_the_columns_are_running_totals_bitwise_a_sum_over_the_rounds(tmp_path):
    """Rounds whose durations are floats that round differently in another order: the columns after each are the
    plain sums over the rounds so far, in their order, bit for bit."""
    run = clock(tmp_path, deadline=7.0)
    tasks = [TaskCost(macs, 100.0, up) for macs, up in [(100.0, 100.0), (0.1, 10.3), (1 / 3, 7.7), (123.4, 0.01)]]
    records = [run.round(number, "train", np.array([(number + shift) % 6 for shift in range(3)]), lambda clients: task)
               for number, task in enumerate(tasks * 3, start=1)]
    for number in range(0, len(records) + 1):
        done = records[:number]
        assert run.columns(number) == {"clock_s": done[-1].end_s if done else 0.0,
                                       "clock_compute_s": float(sum(record.compute_s for record in done)),
                                       "clock_comm_s": float(sum(record.comm_s for record in done)),
                                       "clients_straggled": sum(record.stragglers for record in done),
                                       "clients_dropped": sum(record.dropped for record in done)}
    assert run.columns(1000) == run.columns(len(records))


def test_the_clock_keeps_no_rounds_clients(tmp_path):
    """A round's clients are its stage's to keep: once the stage lets a round go, its arrays are freed (the clock
    remembers its rows only)."""
    run = clock(tmp_path, over_commit=1.5)
    record = run.round(1, "train", np.array([4, 2, 0]), lambda clients: TASK)
    arrays = [weakref.ref(array) for array in (record.selected, record.clients)]
    del record
    assert [array() for array in arrays] == [None, None]
    assert run.table().select(["selected", "finished"]).to_pylist() == [{"selected": 5, "finished": 3}]


def test_rounds_are_clocked_in_the_runs_order(tmp_path):
    """A round's number comes after the last one's, or is the last one's in another stage (TCT's closed form, then
    SCAFFOLD's first round)."""
    run = clock(tmp_path)
    run.round(2, "train", np.array([4, 2, 0]), lambda clients: TASK)
    with pytest.raises(FedrayError, match=r"^the clock's round 2 comes after its round 2: rounds are clocked in the "
                                          r"run's order$"):
        run.round(2, "train", np.array([4, 2, 0]), lambda clients: TASK)
    run.round(2, "tct_scaffold", np.array([4, 2, 0]), lambda clients: TASK)
    with pytest.raises(FedrayError, match=r"^the clock's round 1 comes after its round 2"):
        run.round(1, "tct_closed_form", np.array([4, 2, 0]), lambda clients: TASK)
    assert run.table().select(["round", "stage"]).to_pylist() == [{"round": 2, "stage": "train"},
                                                                  {"round": 2, "stage": "tct_scaffold"}]
