"""The engine's tasks on the clock: secure aggregation's protocol in a participant's task, by hand from its formulas
(Bonawitz et al.'s four rounds, :mod:`fedray.clock.secagg_costs`), SecAgg+ against SecAgg, a closed form's evaluation
block as one group, a run without a protocol timed bit for bit as before, and training's rounds clocked one at a time:
each after the losses of the one before became its clients' utilities, rows every S seconds decided as they come, and
the clients' history kept only for a selector that reads it."""

import math
from dataclasses import dataclass

import numpy as np
import pytest

from fedray.clock.costs import TaskCost
from fedray.clock.devices import Devices
from fedray.clock.rounds import SynchronousRounds
from fedray.clock.run_clock import RunClock, evaluated_rounds
from fedray.clock.selector import PoissonSelector, Selector, UniformSelector
from fedray.engine.clocked import ClockedTraining, ClosedFormTasks, TrainingTasks, clocked_closed_form
from fedray.engine.round_loop import EvalRounds
from fedray.methods.postprocessor import Postprocessing, Postprocessor
from fedray.methods.training.backend import ClientLosses
from fedray.postprocessors.secagg import SecureAggregation

TABLE = """client_id,macs_per_s,down_bps,up_bps
0,100,800,800
1,50,1600,400
2,200,800,1600
3,100,800,800
4,100,800,800
"""
VALUES = 10
"""The upload's values: 40 bytes as float32, masked in the ring."""


def clock(tmp_path, clients: int) -> RunClock:
    table = tmp_path / "devices.csv"
    table.write_text(TABLE)
    return RunClock(Devices(str(table)), None, SynchronousRounds(), UniformSelector(), "uniform", clients, clients,
                    seed=7)


def training(tmp_path, clients: int, postprocessing: Postprocessing):
    """One training round of ``clients`` clients, each 100 multiply-adds of local work and 100 bytes down."""
    tasks = TrainingTasks(np.full(clients, 100.0), 100.0, VALUES, np.ones(clients, dtype=np.int64))
    return ClockedTraining(clock(tmp_path, clients), [np.arange(clients)], tasks, 0, "train", np.ones(clients),
                           postprocessing=postprocessing).record(0)


def secagg(**options) -> Postprocessing:
    return Postprocessing([SecureAggregation(secagg_clip=1.0, **options)], seed=7)


def test_a_secagg_round_of_three_adds_the_protocol_to_each_participants_task(tmp_path):
    """n = 3, every other participant a neighbour (d = 2), the ring Z_2^51 (b = 53 − ⌈log₂ 3⌉): the masked vector is
    ⌈10 · 51 / 8⌉ = 64 bytes. A participant sends 2 keys (2 · 32), 2 shares per neighbour (2 · 32 · 2), its masked
    vector (64) in place of its 40-byte upload and 1 share per neighbour at unmasking (32 · 2): 320 bytes; it receives
    its neighbours' keys (2 · 32 · 2) and the shares addressed to it (2 · 32 · 2), 256 bytes beyond the model's 100; it
    expands d + 1 = 3 masks of 10 words at 6 multiply-adds a word, 180 beyond its 100."""
    record = training(tmp_path, 3, secagg())
    up = 2 * 32 + 2 * 32 * 2 + math.ceil(10 * 51 / 8) + 32 * 2
    down, macs = 100 + 2 * 32 * 2 + 2 * 32 * 2, 100 + 3 * 10 * 6
    assert (up, down, macs) == (320, 356, 280)
    compute = {0: macs / 100, 1: macs / 50, 2: macs / 200}
    transfers = {0: down * 8 / 800 + up * 8 / 800, 1: down * 8 / 1600 + up * 8 / 400, 2: down * 8 / 800 + up * 8 / 1600}
    # client 1 is the slowest: 5.6 s of compute, 1.78 + 6.4 s of transfers
    assert record.end_s == pytest.approx(compute[1] + transfers[1], rel=1e-15) == pytest.approx(13.78, rel=1e-15)
    assert record.compute_s == pytest.approx(5.6, rel=1e-15)
    assert (record.bytes_up, record.bytes_down) == (3 * 320.0, 3 * 356.0)
    plain = training(tmp_path, 3, Postprocessing())  # client 1: 2 s of compute, 0.5 + 0.8 s of transfers
    assert (plain.end_s, plain.bytes_up, plain.bytes_down) == (2.0 + 0.5 + 0.8, 3 * 40.0, 3 * 100.0)


def test_secagg_plus_on_a_k_regular_graph_costs_a_participant_k_neighbours_not_all(tmp_path):
    """n = 5 on the ring Z_2^50 (b = 53 − ⌈log₂ 5⌉): the masked vector is ⌈10 · 50 / 8⌉ = 63 bytes. All pairs (SecAgg,
    d = 4) against k = 2 neighbours (SecAgg+): keys 64 and 3 · 32 · d of shares up, 4 · 32 · d down, (d + 1) · 10 mask
    words. Clients 3 and 4 have client 0's device (100 multiply-adds/s, 800 bits/s each way): client 1 ends the
    round either way."""
    for degree, options in ((4, {}), (2, {"secagg_neighbours": 2})):
        (tmp_path / str(degree)).mkdir()
        record = training(tmp_path / str(degree), 5, secagg(**options))
        up, down, macs = 64 + 3 * 32 * degree + 63, 100 + 4 * 32 * degree, 100 + (degree + 1) * 10 * 6
        assert record.end_s == pytest.approx(macs / 50 + down * 8 / 1600 + up * 8 / 400, rel=1e-15)
        assert (record.bytes_up, record.bytes_down) == (5.0 * up, 5.0 * down)
    assert (64 + 3 * 32 * 4 + 63, 64 + 3 * 32 * 2 + 63) == (511, 319)


def test_a_closed_forms_evaluation_block_is_one_group(tmp_path):
    """Fed3R-like statistics of 10 values, rounds [0, 1] then [2, 3, 4] and client 0 asked again: evaluated every 2
    rounds, the block of both rounds is one group of the 5 clients not yet heard from (d = 4, b = 50, a 63-byte
    vector); evaluated every round (None: as with --eval-every-s), round 1's group is 2 (d = 1, b = 52, 65 bytes) and
    round 2's 3 (d = 2, b = 51, 64 bytes). A client asked again has nothing to send and takes no time."""
    tasks = ClosedFormTasks(np.full(5, 100.0), np.full(5, 40.0), VALUES)
    schedule = [np.array([0, 1]), np.array([2, 3, 4, 0])]
    block = clocked_closed_form(clock(tmp_path, 5), schedule, tasks, "closed_form", secagg(), EvalRounds(2, 2))
    rounds = clocked_closed_form(clock(tmp_path, 5), schedule, tasks, "closed_form", secagg(), None)
    up = {degree: 64 + 3 * 32 * degree + vector for degree, vector in ((4, 63), (1, 65), (2, 64))}
    assert [record.bytes_up for record in block] == [2.0 * up[4], 3.0 * up[4]]
    assert [record.bytes_down for record in block] == [2.0 * 4 * 32 * 4, 3.0 * 4 * 32 * 4]
    assert [record.bytes_up for record in rounds] == [2.0 * up[1], 3.0 * up[2]]
    first = block[0]  # client 1: 100 + 5 · 10 · 6 multiply-adds at 50/s, 512 bytes down at 1600 b/s, its upload at 400
    assert first.end_s == pytest.approx(400 / 50 + 512 * 8 / 1600 + up[4] * 8 / 400, rel=1e-15)


def test_a_run_without_a_protocol_is_timed_bit_for_bit_as_before(tmp_path):
    tasks = TrainingTasks(np.array([100.0, 1 / 3, 7.7]), 100.0, VALUES, np.ones(3, dtype=np.int64))
    expected = clock(tmp_path, 3).round(1, "train", np.arange(3),
                                        lambda clients: TaskCost(tasks.macs[clients], 100.0, 40.0))
    for postprocessing in (Postprocessing(), Postprocessing([Postprocessor()], seed=7)):
        record = ClockedTraining(clock(tmp_path, 3), [np.arange(3)], tasks, 0, "train", np.ones(3),
                                 postprocessing=postprocessing).record(0)
        assert (record.start_s, record.end_s, record.compute_s, record.comm_s, record.bytes_up, record.bytes_down) \
            == (expected.start_s, expected.end_s, expected.compute_s, expected.comm_s, expected.bytes_up,
                expected.bytes_down)
        assert record.clients.tolist() == expected.clients.tolist()


SEEN = []
"""The utilities :class:`Recording` saw, a round each."""


@dataclass(frozen=True)
class Recording(Selector):
    """Reads the clients' utility: keeps what it saw, asks the schedule's clients."""

    uses_utility = True

    def select(self, context):
        SEEN.append(context.history.utility.copy())
        return context.scheduled


def test_a_round_is_clocked_when_asked_after_the_last_ones_losses_became_utilities(tmp_path):
    """Round 1's clients 0, 1, 2 (4, 9 and 1 samples) measured Σ loss² = 8, 18 and 2: round 2's selector sees Oort's
    |B| · sqrt(Σ loss² / |B|) = 4√2, 9√2, √2 for them and nothing for the others."""
    SEEN.clear()
    table = tmp_path / "devices.csv"
    table.write_text(TABLE)
    run_clock = RunClock(Devices(str(table)), None, SynchronousRounds(), Recording(), "recording", 5, 3, seed=7)
    tasks = TrainingTasks(np.full(5, 100.0), 100.0, VALUES, np.ones(5, dtype=np.int64))
    measured = {1: ClientLosses(np.array([0, 2, 1]), np.array([8.0, 2.0, 18.0]))}
    rounds = ClockedTraining(run_clock, [np.array([0, 1, 2]), np.array([2, 3, 4])], tasks, 0, "train",
                             np.array([4, 9, 1, 16, 25]), measured.get)
    assert len(rounds) == 2 and rounds[0].tolist() == [0, 1, 2]
    assert len(run_clock.log) == 1 and np.isnan(SEEN[0]).all()
    assert rounds[1].tolist() == [2, 3, 4] and len(run_clock.log) == 2
    assert SEEN[1][:3].tolist() == [4 * math.sqrt(2), 9 * math.sqrt(2), math.sqrt(2)] and np.isnan(SEEN[1][3:]).all()
    assert rounds[0].tolist() == [0, 1, 2] and len(SEEN) == 2  # a round asked again is not clocked again


@dataclass(frozen=True)
class ReadsHistory(Selector):
    """A plugin that says nothing of what it reads: the clock keeps the history for it."""

    def select(self, context):
        return context.scheduled


@pytest.mark.parametrize("selector, kept", [(UniformSelector(), False), (PoissonSelector(), False),
                                            (ReadsHistory(), True), (Recording(), True)])
def test_the_clock_keeps_the_clients_history_only_for_a_selector_that_reads_it(tmp_path, selector, kept):
    table = tmp_path / "devices.csv"
    table.write_text(TABLE)
    run_clock = RunClock(Devices(str(table)), None, SynchronousRounds(), selector, "mine", 5, 3, seed=7)
    run_clock.round(1, "train", np.array([0, 3, 4]), lambda clients: TaskCost(100.0, 100.0, 40.0))
    assert run_clock.history.kept == kept
    if kept:
        assert run_clock.history.rounds.tolist() == [1, 0, 0, 1, 1]


def test_rounds_every_s_seconds_are_decided_round_by_round_as_all_at_once(tmp_path):
    tasks = TrainingTasks(np.array([100.0, 60.0, 250.0, 30.0, 80.0]), 100.0, VALUES, np.ones(5, dtype=np.int64))
    schedule = [np.array([0, 1]), np.array([2]), np.array([3, 4]), np.array([1]), np.array([2, 4]), np.array([0])]
    for every_s in (1.0, 2.5, 4.0, 100.0):
        rounds = ClockedTraining(clock(tmp_path, 5), schedule, tasks, 0, "train", np.ones(5))
        evaluated = {number for number in range(len(schedule) + 1) if number in rounds.every_s(every_s)}
        ends = np.array([rounds.record(index).end_s for index in range(len(schedule))])
        assert evaluated == {0} | evaluated_rounds(ends, 0.0, every_s)
    assert evaluated == {0, 6}
