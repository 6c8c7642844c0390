"""Schedules drawn as they are read: bitwise the rounds of the schedule built whole (runs on disk reproduce), in any
order of reading, in O(K) memory at a million clients."""

import pickle
import tracemalloc

import numpy as np
import pytest

from fedray.core.errors import FedrayError
from fedray.runtime import sampling
from fedray.runtime.sampling import CHUNK_ROUNDS, check_per_round, distinct_draws
from fedray.runtime.schedules import Schedule


def reference_schedule(num_clients, per_round, replacement, seed, max_rounds=None, past_coverage=False):
    """The schedule as fedray built it whole before it was lazy (copied as it was)."""
    check_per_round(num_clients, per_round)
    rng = np.random.default_rng([seed, 21])
    more = past_coverage and max_rounds is not None
    if not replacement:
        passes = -(-max_rounds // -(-num_clients // per_round)) if more else 1
        orders = [rng.permutation(num_clients) for _ in range(passes)]
        rounds = [order[i : i + per_round] for order in orders for i in range(0, num_clients, per_round)]
        return rounds[:max_rounds]
    rounds = []
    seen = np.zeros(num_clients, dtype=bool)
    while (more or not seen.all()) and (max_rounds is None or len(rounds) < max_rounds):
        for row in distinct_draws(rng, num_clients, per_round, CHUNK_ROUNDS):
            rounds.append(row)
            seen[row] = True
            if (seen.all() and not more) or len(rounds) == max_rounds:
                break
    return rounds


def reference_first_seen_rounds(num_clients, per_round, rng):
    """The first-seen rounds as fedray computed them before (an O(K) scan a chunk)."""
    first = np.full(num_clients, -1, dtype=np.int64)
    start = 0
    while (first < 0).any():
        rounds = distinct_draws(rng, num_clients, per_round, CHUNK_ROUNDS)
        clients, position = np.unique(rounds.ravel(), return_index=True)
        new = first[clients] < 0
        first[clients[new]] = start + position[new] // per_round
        start += CHUNK_ROUNDS
    return first


def assert_same_rounds(rounds, reference):
    assert len(rounds) == len(reference)
    for got, expected in zip(rounds, reference, strict=True):
        assert got.dtype == expected.dtype and np.array_equal(got, expected)


# (K, κ): κ² ≤ K (all rows drawn at once, clashes redrawn) and κ² > K (each row on its own); K = 3,000 at κ = 2 needs
# about 12,000 rounds (a dozen chunks) to see everyone, K = 7 at κ = 3 does not divide into rounds.
POPULATIONS = [(3000, 2), (95, 9), (95, 10), (7, 3), (1, 1), (12, 12)]
LIMITS = [None, 0, 1, 5, CHUNK_ROUNDS - 1, CHUNK_ROUNDS, CHUNK_ROUNDS + 1, 2600]


@pytest.mark.parametrize("replacement", [False, True], ids=["without", "with"])
@pytest.mark.parametrize("num_clients, per_round", POPULATIONS)
def test_a_schedule_is_bitwise_the_schedule_built_whole(num_clients, per_round, replacement):
    for seed in (0, 7):
        for max_rounds in LIMITS:
            for past_coverage in (False, True):
                rounds = sampling.schedule(num_clients, per_round, replacement, seed, max_rounds, past_coverage)
                assert isinstance(rounds, Schedule)
                assert_same_rounds(rounds, reference_schedule(num_clients, per_round, replacement, seed, max_rounds,
                                                              past_coverage))


@pytest.mark.parametrize("replacement", [False, True], ids=["without", "with"])
def test_rounds_read_in_any_order_are_the_same(replacement):
    """A chunk (a permutation) read again is drawn again from its start's state: backwards, at random, twice."""
    reference = reference_schedule(40, 3, replacement, 5, 3000, past_coverage=True)
    rounds = sampling.schedule(40, 3, replacement, 5, 3000, past_coverage=True)
    order = np.random.default_rng(0).permutation(3000)
    for index in [2999, 0, 1500, *range(2999, -1, -1), *order, *order]:
        assert np.array_equal(rounds[index], reference[index])
    assert np.array_equal(rounds[-1], reference[-1]) and np.array_equal(rounds[-3000], reference[0])
    with pytest.raises(IndexError):
        rounds[3000]
    with pytest.raises(IndexError):
        rounds[-3001]


def test_slices_and_joins_are_those_of_a_list():
    reference = reference_schedule(30, 4, True, 2, 2500, past_coverage=True)
    rounds = sampling.schedule(30, 4, True, 2, 2500, past_coverage=True)
    for cut in [slice(None), slice(3, 9), slice(2400, None), slice(None, -5), slice(-3, None), slice(10, 3),
                slice(5, 2000, 7), slice(None, None, -1), slice(2000, 100, -13), slice(7, 7)]:
        assert isinstance(rounds[cut], Schedule)
        assert_same_rounds(rounds[cut], reference[cut])
        assert_same_rounds(rounds[cut][1:-1:2], reference[cut][1:-1:2])
    everyone = np.arange(30)
    joined = rounds[:3] + rounds[1020:1030] + [everyone] + rounds[5:6]
    assert_same_rounds(joined, reference[:3] + reference[1020:1030] + [everyone] + reference[5:6])
    assert_same_rounds(joined[2:14], (reference[:3] + reference[1020:1030] + [everyone])[2:14])
    assert_same_rounds(Schedule.of() + rounds[:2], reference[:2])
    assert len(Schedule.of()) == 0 and not Schedule.of()
    assert np.array_equal(np.concatenate(rounds[:3]), np.concatenate(reference[:3]))
    assert_same_rounds(pickle.loads(pickle.dumps(joined)), reference[:3] + reference[1020:1030] + [everyone] + reference[5:6])


def test_a_schedules_rounds_cannot_be_changed():
    for replacement in (False, True):
        rounds = sampling.schedule(20, 4, replacement, 0)
        with pytest.raises(ValueError, match="read-only"):
            rounds[0][0] = 99
        assert np.array_equal(rounds[0], reference_schedule(20, 4, replacement, 0)[0])


def test_packed_rounds_read_as_the_rounds_they_were_in_half_the_bytes():
    """A schedule of rounds kept in one array (a closed form's rounds on the clock): each round reads as its int64
    array, slices and joins as a list's; stored in int32 below 2³¹ clients (in int64 above)."""
    rounds = [np.array(clients, dtype=np.int64) for clients in ([5, 0, 999_999], [], [3], [7, 2])]
    packed = Schedule.packed(rounds)
    assert len(packed) == 4 and packed == rounds
    assert all(clients.dtype == np.int64 for clients in packed)
    assert packed[1:3] == rounds[1:3] and packed[2:] + packed[:1] == rounds[2:] + rounds[:1]
    assert packed._source._clients.nbytes == 6 * 4
    wide = Schedule.packed([np.array([2**31, 1])])
    assert wide == [np.array([2**31, 1])] and wide._source._clients.dtype == np.int64
    assert Schedule.packed([]) == []


@pytest.mark.slow  # a full-size schedule (10⁶ clients), built whole as the reference: 10 s
def test_a_million_clients_with_replacement_until_coverage_take_o_k_memory():
    """K = 10⁶, κ = 100: about 155,000 rounds, 124 MB as arrays of clients (the schedule built whole peaks above
    100 MB); drawn as read, the schedule holds O(K) numbers (the 8 MB of first-seen rounds while it finds its end) and
    one chunk of 1,024 rounds (0.8 MB)."""
    tracemalloc.start()
    try:
        rounds = sampling.schedule(10**6, 100, True, 0)
        read = {index: rounds[index].copy() for index in (0, 1, len(rounds) // 2, -2, -1)}
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        reference = reference_schedule(10**6, 100, True, 0)
        reference_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40e6 < 100e6 < reference_peak
    assert len(rounds) == len(reference) > 150_000
    assert all(np.array_equal(clients, reference[index]) for index, clients in read.items())
    assert len(np.unique(np.concatenate(reference[:-1]))) == 10**6 - 1, "the last round sees the last client"


@pytest.mark.parametrize("num_clients, per_round", [(3000, 2), (95, 10), (1262, 50), (1, 1)])
def test_first_seen_rounds_are_those_of_the_scan_over_every_client(num_clients, per_round):
    for seed in (0, 3):
        first = sampling.first_seen_rounds(num_clients, per_round, np.random.default_rng([seed, 22]))
        assert np.array_equal(first, reference_first_seen_rounds(num_clients, per_round, np.random.default_rng([seed, 22])))


def test_coverage_is_that_of_the_scan_over_every_client():
    """One trial's rounds to see each fraction of 10⁵ clients, from the stream of trial 0."""
    result = sampling.coverage(10**5, 100, replacement=True, trials=1, seed=4)
    ordered = np.sort(reference_first_seen_rounds(10**5, 100, np.random.default_rng([4, 22, 0]))) + 1
    assert result == {0.25: (float(ordered[25_000 - 1]), 0.0), 0.5: (float(ordered[50_000 - 1]), 0.0),
                      0.75: (float(ordered[75_000 - 1]), 0.0), 1.0: (float(ordered[-1]), 0.0)}


def test_more_rounds_than_a_sequence_counts_are_refused():
    sampling.check_rounds(2**63 - 1)
    with pytest.raises(FedrayError) as refused:
        sampling.check_rounds(2**63, "--tct-rounds")
    assert str(refused.value) == "--tct-rounds must be at most 2^63 - 1, got 9223372036854775808"


def test_schedules_compare_as_the_rounds_they_hold():
    rounds = sampling.schedule(40, 3, False, 5, 20)
    again = sampling.schedule(40, 3, False, 5, 20)
    assert rounds is not again and rounds == again and rounds[:4] == again[:4]
    assert rounds == [np.array(clients) for clients in again]          # a list of the same rounds
    assert rounds != sampling.schedule(40, 3, False, 6, 20)             # another seed
    assert len(rounds) == 14 and rounds != rounds[:13] and rounds[:4] != again[1:5]  # 40 clients, 3 a round
    assert (rounds == 3) is False
