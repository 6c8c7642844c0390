"""The synchronous round on the clock, worked by hand on a small federation: durations, over-commitment's choice, the
deadline's stragglers, partial work and dropouts (exact values)."""

import numpy as np
import pytest

from fedray.clock.rounds import SynchronousRounds
from fedray.clock.selector import ClientHistory, RoundContext, UniformSelector
from fedray.core.errors import FedrayError
from fedray.core.options import options_of
from fedray.runtime.sampling import schedule

# Five selected clients, in the selector's order. Their uploads would arrive at start + comm + compute:
# client 7 at 103, 3 at 105, 9 at 103, 1 at 110, 4 at 104 (start 100).
CLIENTS = np.array([7, 3, 9, 1, 4])
COMPUTE = np.array([2.0, 4.0, 1.0, 8.0, 3.0])
COMM = np.array([1.0, 1.0, 2.0, 2.0, 1.0])
START = 100.0


class OfflineAt:
    """Each listed client goes offline for good at the given time; the others stay online."""

    def __init__(self, offline_at: dict[int, float]) -> None:
        self.offline_at = offline_at

    def available(self, clients, t):
        return np.array([t < self.offline_at.get(int(client), np.inf) for client in clients])

    def stays_available(self, clients, t0, t1):
        return np.array([end <= self.offline_at.get(int(client), np.inf) for client, end in zip(clients, t1)])


def equal(array, expected):
    return array.dtype == np.int64 and array.tolist() == expected


def test_without_a_deadline_every_client_finishes_in_the_order_of_its_time_then_its_id():
    outcome = SynchronousRounds().run(CLIENTS, COMPUTE, COMM, START, keep=5)
    assert equal(outcome.finished, [7, 9, 4, 3, 1])  # 7 and 9 tie at 103: the lower id first
    assert outcome.finish_s.tolist() == [103.0, 103.0, 104.0, 105.0, 110.0]
    assert (outcome.start_s, outcome.end_s) == (100.0, 110.0)
    assert outcome.steps is None
    assert all(equal(part, []) for part in (outcome.stragglers, outcome.dropped, outcome.cut))


def test_the_order_of_the_given_arrays_does_not_matter():
    order = np.array([4, 2, 0, 3, 1])
    shuffled = SynchronousRounds().run(CLIENTS[order], COMPUTE[order], COMM[order], START, keep=3)
    assert equal(shuffled.finished, [7, 9, 4])


def test_over_commitment_keeps_the_first_kappa_to_finish_and_cuts_the_rest():
    outcome = SynchronousRounds(over_commit=1.3).run(CLIENTS, COMPUTE, COMM, START, keep=3)
    assert equal(outcome.finished, [7, 9, 4])
    assert outcome.end_s == 104.0
    assert equal(outcome.cut, [1, 3])
    assert equal(outcome.stragglers, []) and equal(outcome.dropped, [])


def test_over_commitment_asks_the_ceiling_of_o_kappa_in_decimal():
    assert SynchronousRounds(over_commit=1.3).wanted(10, 100) == 13
    assert SynchronousRounds(over_commit=1.1).wanted(10, 100) == 11  # 1.1 * 10 is 11.000000000000002 in floats
    assert SynchronousRounds(over_commit=1.25).wanted(3, 100) == 4
    assert SynchronousRounds().wanted(7, 100) == 7
    assert SynchronousRounds(over_commit=2.0).wanted(60, 100) == 100


def test_a_deadline_drops_the_late_uploads_and_the_round_waits_for_it():
    outcome = SynchronousRounds(deadline=4.5).run(CLIENTS, COMPUTE, COMM, START, keep=5)
    assert equal(outcome.finished, [7, 9, 4])
    assert equal(outcome.stragglers, [1, 3])
    assert outcome.end_s == 104.5
    assert equal(outcome.cut, [])


def test_a_round_that_fills_before_the_deadline_ends_there_and_its_late_clients_are_cut_not_stragglers():
    outcome = SynchronousRounds(over_commit=1.7, deadline=4.5).run(CLIENTS, COMPUTE, COMM, START, keep=3)
    assert equal(outcome.finished, [7, 9, 4]) and outcome.end_s == 104.0
    assert equal(outcome.cut, [1, 3]) and equal(outcome.stragglers, [])


def test_a_deadline_every_client_meets_changes_nothing():
    steps = np.full(5, 3)
    plain = SynchronousRounds().run(CLIENTS, COMPUTE, COMM, START, keep=5, local_steps=steps)
    for mode in ("drop", "partial"):
        met = SynchronousRounds(deadline=10.0, stragglers=mode).run(CLIENTS, COMPUTE, COMM, START, keep=5,
                                                                     local_steps=steps)
        for part in ("finished", "finish_s", "steps", "stragglers", "dropped", "cut"):
            assert np.array_equal(getattr(met, part), getattr(plain, part))
        assert met.end_s == plain.end_s == 110.0


# With partial work: a sixth client (5: compute 6, comm 4, two steps) and each client's local steps.
PARTIAL_CLIENTS = np.array([7, 3, 9, 1, 4, 5])
PARTIAL_COMPUTE = np.array([2.0, 4.0, 1.0, 8.0, 3.0, 6.0])
PARTIAL_COMM = np.array([1.0, 1.0, 2.0, 2.0, 1.0, 4.0])
STEPS = np.array([4, 16, 2, 4, 3, 2])


def test_partial_work_sends_the_steps_done_by_the_deadline():
    # Deadline 4.5: client 3 has 4.5 − 1 = 3.5 s for steps of 4/16 = 0.25 s: 14 steps, done at 101 + 3.5 = 104.5.
    # Client 1 has 4.5 − 2 = 2.5 s for steps of 8/4 = 2 s: ⌊1.25⌋ = 1 step, done at 102 + 2 = 104.
    # Client 5 has 0.5 s for steps of 3 s: no step, nothing to send; the server knows at the deadline.
    rounds = SynchronousRounds(deadline=4.5, stragglers="partial")
    outcome = rounds.run(PARTIAL_CLIENTS, PARTIAL_COMPUTE, PARTIAL_COMM, START, keep=6, local_steps=STEPS)
    assert equal(outcome.finished, [7, 9, 1, 4, 3])
    assert outcome.finish_s.tolist() == [103.0, 103.0, 104.0, 104.0, 104.5]
    assert equal(outcome.steps, [4, 2, 1, 3, 14])
    assert equal(outcome.stragglers, [1, 3, 5])
    assert outcome.end_s == 104.5
    assert equal(outcome.cut, []) and equal(outcome.dropped, [])


def test_partial_work_with_over_commitment_keeps_the_first_uploads_whole_or_partial():
    rounds = SynchronousRounds(over_commit=1.5, deadline=4.5, stragglers="partial")
    outcome = rounds.run(PARTIAL_CLIENTS, PARTIAL_COMPUTE, PARTIAL_COMM, START, keep=4, local_steps=STEPS)
    assert equal(outcome.finished, [7, 9, 1, 4]) and equal(outcome.steps, [4, 2, 1, 3])
    assert outcome.end_s == 104.0
    assert equal(outcome.cut, [3, 5])  # 3's partial upload comes at 104.5; 5's fate is known only at 104.5
    assert equal(outcome.stragglers, [1])


def test_a_client_offline_before_it_finishes_drops_out():
    availability = OfflineAt({9: 102.5, 3: 104.9, 7: 103.0})  # 7 goes offline as its upload arrives: in time
    outcome = SynchronousRounds().run(CLIENTS, COMPUTE, COMM, START, keep=5, availability=availability)
    assert equal(outcome.finished, [7, 4, 1])
    assert equal(outcome.dropped, [3, 9])
    assert outcome.end_s == 110.0


def test_a_dropout_after_the_round_filled_is_cut():
    availability = OfflineAt({9: 102.5, 3: 104.9})
    outcome = SynchronousRounds(over_commit=2.5).run(CLIENTS, COMPUTE, COMM, START, keep=2, availability=availability)
    assert equal(outcome.finished, [7, 4]) and outcome.end_s == 104.0
    assert equal(outcome.dropped, [9])  # its upload was due at 103, before the end
    assert equal(outcome.cut, [1, 3])


def test_a_partial_straggler_is_checked_online_only_until_its_partial_upload():
    availability = OfflineAt({3: 104.6})  # 3 would finish whole at 105 but sends its 14 steps at 104.5
    rounds = SynchronousRounds(deadline=4.5, stragglers="partial")
    outcome = rounds.run(PARTIAL_CLIENTS, PARTIAL_COMPUTE, PARTIAL_COMM, START, keep=6, local_steps=STEPS,
                         availability=availability)
    assert equal(outcome.finished, [7, 9, 1, 4, 3]) and equal(outcome.dropped, [])


def test_an_event_loop_chains_rounds_each_selected_at_its_start_from_the_clients_online_then():
    # Client c is online at t unless (c + ⌊t⌋) is a multiple of 3, and takes 1 + (c mod 4) s of compute, 0.5 s of
    # transfers: 1.5 to 4.5 s, so with a 3 s deadline those with c mod 4 ≥ 2 are late. Round r starts when round
    # r − 1 ends, so who is online at its start depends on the rounds before it.
    availability = OfflineAt({})
    availability.available = lambda clients, t: (clients + int(t)) % 3 != 0
    scheduler, num_clients, start = SynchronousRounds(over_commit=1.5, deadline=3.0), 12, 0.0
    today = schedule(num_clients, 4, True, seed=1, max_rounds=3, past_coverage=True)
    starts = []
    for r in range(3):
        round_context = RoundContext(round=r, start_s=start, per_round=4, wanted=scheduler.wanted(4, num_clients),
                                     num_clients=num_clients, seed=1, scheduled=today[r],
                                     history=ClientHistory(num_clients), availability=availability)
        picked = UniformSelector().select(round_context)
        assert len(picked) == 6 and ((picked + int(start)) % 3 != 0).all()
        outcome = scheduler.run(picked, 1.0 + picked % 4, np.full(6, 0.5), start, keep=4, availability=availability)
        on_time = sorted((1.5 + c % 4, c) for c in picked.tolist() if c % 4 <= 1)
        assert outcome.finished.tolist() == [c for _, c in on_time[:4]]
        if len(on_time) >= 4:
            assert outcome.end_s == start + on_time[3][0] and len(outcome.stragglers) == 0
        else:
            assert outcome.end_s == start + 3.0
            assert outcome.stragglers.tolist() == sorted(c for c in picked.tolist() if c % 4 >= 2)
        starts.append(start)
        start = outcome.end_s
    assert starts[0] == 0.0 and starts[1] > 0.0 and starts[2] > starts[1]


def test_the_options_are_declared_for_the_command_line():
    options = options_of(SynchronousRounds)
    assert list(options) == ["over_commit", "deadline", "stragglers"]
    assert options["stragglers"].choices == ("drop", "partial")
    assert options["deadline"].optional and options["deadline"].default is None


@pytest.mark.parametrize("options, message", [
    ({"over_commit": 0.9}, "--over-commit must be a finite number ≥ 1, got 0.9"),
    ({"over_commit": float("nan")}, "--over-commit must be a finite number ≥ 1, got nan"),
    ({"deadline": 0.0}, "--deadline must be a finite number of seconds > 0, got 0.0"),
    ({"deadline": -3.0}, "--deadline must be a finite number of seconds > 0, got -3.0"),
    ({"stragglers": "wait"}, "--stragglers must be drop or partial, got 'wait'"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(FedrayError, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
        SynchronousRounds(**options)


@pytest.mark.parametrize("change, message", [
    ({"compute_s": np.array([2.0, -1.0, 1.0, 8.0, 3.0])}, "a round's compute_s must be finite seconds ≥ 0, got -1.0 "
                                                           "for client 3"),
    ({"comm_s": np.array([1.0, 1.0, np.nan, 2.0, 1.0])}, "a round's comm_s must be finite seconds ≥ 0, got nan for "
                                                          "client 9"),
    ({"comm_s": np.ones(4)}, "a round needs one compute_s and one comm_s per selected client, got 5 clients, 5 "
                             "compute_s and 4 comm_s"),
    ({"clients": np.array([7, 3, 9, 3, 4])}, "a round's selected clients must be distinct"),
])
def test_bad_round_inputs_are_refused_in_one_line(change, message):
    given = {"clients": CLIENTS, "compute_s": COMPUTE, "comm_s": COMM, **change}
    with pytest.raises(FedrayError, match=f"^{message}$"):
        SynchronousRounds().run(start_s=START, keep=5, **given)


def test_partial_work_needs_the_local_steps():
    with pytest.raises(FedrayError, match="^--stragglers partial needs each client's local steps$"):
        SynchronousRounds(deadline=4.0, stragglers="partial").run(CLIENTS, COMPUTE, COMM, START, keep=5)
