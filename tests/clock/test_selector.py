"""Client selection: the built-ins pick today's schedule bit for bit when everyone is online, and otherwise draw only
among the clients online at the round's start, uniformly, in O(κ) lookups a round."""

import numpy as np
import pytest
import scipy.stats

from fedray.clock.selector import (
    SELECTORS, ClientHistory, PoissonSelector, RoundContext, UniformSelector, _first_in_order, _not_among,
    check_selection, uniforms,
)
from fedray.core.errors import FedrayError
from fedray.runtime.sampling import schedule

ALPHA = 1e-3


class OnlineSet:
    """The listed clients are online, always; every lookup's size is recorded."""

    def __init__(self, online) -> None:
        self.online = np.asarray(online)
        self.looked_up = 0

    def available(self, clients, t):
        self.looked_up += len(clients)
        return np.isin(clients, self.online)


class Everyone:
    def available(self, clients, t):
        return np.ones(len(clients), dtype=bool)


class ThirdOffline:
    """Client c is offline at time t when (c + t) is a multiple of 3."""

    def available(self, clients, t):
        return (clients + int(t)) % 3 != 0


def context(round, scheduled, num_clients, wanted=None, availability=None, seed=3, per_round=None):
    return RoundContext(round=round, start_s=float(round), per_round=per_round or len(scheduled),
                        wanted=len(scheduled) if wanted is None else wanted, num_clients=num_clients, seed=seed,
                        scheduled=scheduled, history=ClientHistory(num_clients), availability=availability)


@pytest.mark.parametrize("sampling", ["without", "with", "poisson"])
@pytest.mark.parametrize("availability", [None, Everyone()])
def test_with_everyone_online_the_built_ins_pick_todays_schedule_bit_for_bit(sampling, availability):
    today = schedule(37, 5, sampling == "with", seed=11, max_rounds=40, past_coverage=True,
                     poisson=sampling == "poisson")
    selector = SELECTORS["poisson" if sampling == "poisson" else "uniform"]()
    picked = [selector.select(context(r, today[r], 37, availability=availability)) for r in range(len(today))]
    assert len(picked) == 40
    assert all(mine.dtype == theirs.dtype and mine.tobytes() == theirs.tobytes() for mine, theirs in zip(picked, today))
    if sampling == "without":  # a pass's last round holds 37 mod 5 = 2 clients, and no more are drawn
        assert [len(rows) for rows in picked[:8]] == [5] * 7 + [2]


def test_uniform_keeps_the_scheduled_clients_online_in_their_order_then_fills_from_the_online_ones():
    scheduled = np.array([4, 9, 12, 5, 7], dtype=np.int64)  # at t = 0, 9 and 12 are offline
    picked = UniformSelector().select(context(0, scheduled, 40, wanted=7, availability=ThirdOffline()))
    assert picked[:3].tolist() == [4, 5, 7]
    assert len(picked) == 7 and len(np.unique(picked)) == 7
    assert (picked % 3 != 0).all()


def test_a_selection_is_a_pure_function_of_the_round_whatever_the_order_of_calls():
    today = schedule(60, 6, True, seed=2, max_rounds=10, past_coverage=True)
    contexts = [context(r, today[r], 60, wanted=8, availability=ThirdOffline()) for r in range(10)]
    forward = [UniformSelector().select(c) for c in contexts]
    backward = [UniformSelector().select(c) for c in reversed(contexts)][::-1]
    assert all(np.array_equal(a, b) for a, b in zip(forward, backward))
    assert not all(np.array_equal(forward[0][:8], row[:8]) for row in forward[1:])


def uniform_counts(num_clients, online, per_round, rounds, wanted):
    """How often each client was picked over ``rounds`` rounds drawn with replacement."""
    today = schedule(num_clients, per_round, True, seed=5, max_rounds=rounds, past_coverage=True)
    availability = OnlineSet(online)
    counts = np.zeros(num_clients, dtype=np.int64)
    for r in range(rounds):
        picked = UniformSelector().select(context(r, today[r], num_clients, wanted=wanted, availability=availability))
        assert len(picked) == wanted and len(np.unique(picked)) == wanted
        counts[picked] += 1
    return counts, availability


def test_the_fill_is_uniform_over_the_online_clients():
    online = np.array([0, 2, 3, 7, 11, 13, 17, 19, 23, 24, 28, 29])
    counts, _ = uniform_counts(30, online, per_round=4, rounds=3000, wanted=5)  # over-committed: ⌈1.25 · 4⌉
    assert counts[np.setdiff1d(np.arange(30), online)].sum() == 0
    assert counts.sum() == 3000 * 5
    assert scipy.stats.chisquare(counts[online]).pvalue > ALPHA


def test_with_few_clients_online_the_fill_passes_over_everyone_once_and_stays_uniform():
    online = np.arange(7, 10_000, 500)  # 20 of 10,000: the draws' budget runs out, one pass over the clients ends it
    counts, availability = uniform_counts(10_000, online, per_round=3, rounds=1000, wanted=4)
    assert counts[np.setdiff1d(np.arange(10_000), online)].sum() == 0
    assert scipy.stats.chisquare(counts[online]).pvalue > ALPHA
    assert availability.looked_up > 500 * 10_000  # most rounds ended in the pass over everyone


def test_a_round_with_fewer_clients_online_than_asked_takes_all_of_them():
    scheduled = np.array([1, 2, 3, 40, 5], dtype=np.int64)
    picked = UniformSelector().select(context(4, scheduled, 50, availability=OnlineSet([3, 17, 40])))
    assert picked[:2].tolist() == [3, 40] and sorted(picked.tolist()) == [3, 17, 40]


def test_a_round_at_a_million_clients_looks_up_order_kappa_clients():
    num_clients, per_round = 1_000_000, 100
    today = schedule(num_clients, per_round, True, seed=1, max_rounds=3, past_coverage=True)
    availability = OnlineSet(np.arange(0, num_clients, 2))  # half online
    for r in range(3):
        picked = UniformSelector().select(context(r, today[r], num_clients, wanted=130, availability=availability))
        assert len(picked) == 130 and (picked % 2 == 0).all()
    assert availability.looked_up < 3 * 20 * 130


def test_poisson_keeps_each_online_client_at_the_schedules_rate():
    num_clients, per_round, rounds = 40, 8, 2000
    today = schedule(num_clients, per_round, False, seed=9, max_rounds=rounds, past_coverage=True, poisson=True)
    online = np.arange(0, num_clients, 4)
    counts = np.zeros(num_clients, dtype=np.int64)
    for r in range(rounds):
        picked = PoissonSelector().select(context(r, today[r], num_clients, wanted=99,
                                                  availability=OnlineSet(online), per_round=per_round))
        assert picked.tolist() == [c for c in today[r].tolist() if c % 4 == 0]
        counts[picked] += 1
    assert counts[np.setdiff1d(np.arange(num_clients), online)].sum() == 0
    rate = per_round / num_clients  # each online client's count is Binomial(rounds, q)
    assert scipy.stats.chisquare(counts[online], np.full(len(online), rate * rounds),
                                 sum_check=False).pvalue > ALPHA


def test_the_history_records_what_arrived():
    history = ClientHistory(6)
    history.record(np.array([4, 1]), round=0, duration_s=np.array([3.0, 5.0]))
    history.record(np.array([1]), round=2, duration_s=np.array([2.5]), utility=np.array([7.0]))
    assert history.rounds.tolist() == [0, 2, 0, 0, 1, 0]
    assert history.last_round.tolist() == [-1, 2, -1, -1, 0, -1]
    assert np.array_equal(history.duration_s, [np.nan, 2.5, np.nan, np.nan, 3.0, np.nan], equal_nan=True)
    assert np.array_equal(history.utility, [np.nan, 7.0, np.nan, np.nan, np.nan, np.nan], equal_nan=True)


def test_a_history_not_kept_records_nothing_and_refuses_to_be_read():
    history = ClientHistory(6, kept=False)
    history.record(np.array([4, 1]), round=0, duration_s=np.array([3.0, 5.0]))
    for name in ("rounds", "last_round", "duration_s", "utility"):
        with pytest.raises(FedrayError, match="^this run's selector declares reads_history = False, so the clock "
                                               "keeps no client history: set reads_history = True"):
            getattr(history, name)


def test_uniforms_are_a_pure_function_of_seed_stream_client_and_round():
    clients = np.array([5, 0, 999_999, 5])
    drawn = uniforms(7, 45, clients, 3)
    assert drawn[0] == drawn[3] and len(np.unique(drawn)) == 3
    assert np.array_equal(drawn[1:3], uniforms(7, 45, clients[1:3], 3))
    for other in (uniforms(7, 46, clients, 3), uniforms(8, 45, clients, 3), uniforms(7, 45, clients, 4)):
        assert not np.isin(drawn, other).any()
    assert ((drawn >= 0) & (drawn < 1)).all()


@pytest.mark.parametrize("picked, message", [
    (np.array([1.0, 2.0]), "selector mine must return a 1-d array of client ids, got float64 of shape \\(2,\\)"),
    (np.array([1, 50]), "selector mine picked a client outside 0..49 in round 4"),
    (np.array([1, 2, 1]), "selector mine picked a client twice in round 4"),
    (np.array([1, 2]), "selector mine picked a client offline at the start of round 4"),  # (2 + 4) % 3 == 0
])
def test_a_selection_that_is_not_distinct_online_clients_is_refused_in_one_line(picked, message):
    round_context = context(4, np.arange(5), 50, availability=ThirdOffline())
    with pytest.raises(FedrayError, match=f"^{message}$"):
        check_selection(round_context, picked, "mine")


def test_a_selection_of_distinct_online_clients_passes_as_int64():
    checked = check_selection(context(4, np.arange(5), 50, availability=ThirdOffline()), np.array([1, 4], np.int32),
                              "mine")
    assert checked.dtype == np.int64 and checked.tolist() == [1, 4]


def drawn_in_batches(context, count, taken):
    """The fill's draws as the module's note says, batch by batch (a plain reference): candidates from stream 45 in
    batches of max(2·(still needed), 64) while fewer than ``count`` are found and fewer than 16·count + 1024 drawn;
    then the online clients left, ordered by stream 46."""
    picked, drawn = [], 0
    online = set(context.availability.online.tolist())
    while len(picked) < count and drawn < 16 * count + 1024:
        size = max(2 * (count - len(picked)), 64)
        for u in uniforms(context.seed, 45, np.arange(drawn, drawn + size), context.round):
            client = int(np.floor(u * context.num_clients))
            if client in online and client not in taken and client not in picked and len(picked) < count:
                picked.append(client)
        drawn += size
    if len(picked) < count:
        rest = [client for client in range(context.num_clients) if client in online and client not in taken
                and client not in picked]
        keys = uniforms(context.seed, 46, np.array(rest, dtype=np.int64), context.round)
        picked += [rest[index] for index in np.argsort(keys, kind="stable")][:count - len(picked)]
    return picked


@pytest.mark.parametrize("online_share", [0.9, 0.3, 0.05, 0.004])
def test_a_fill_picks_the_first_distinct_online_draws_batch_by_batch_or_falls_back_to_a_pass(online_share):
    """Many online (found in the first draws), few (found after many) and fewer than asked (the pass)."""
    num_clients = 2000
    for round in range(6):
        rng = np.random.default_rng(round)
        online = np.flatnonzero(rng.random(num_clients) < online_share)
        taken = online[:3]
        fill = context(round, np.zeros(0, dtype=np.int64), num_clients, availability=OnlineSet(online))
        for count in (1, 20, 130):
            assert fill.draw_online(count, taken).tolist() == drawn_in_batches(fill, count, set(taken.tolist()))


def test_a_pass_leaves_out_the_clients_taken_and_orders_the_rest_as_a_stable_argsort_of_their_draws():
    """The pass's two steps against numpy's plain ones, on random cases with ties in the keys: ``~np.isin`` and the
    first ``count`` of ``np.argsort(kind="stable")``."""
    rng = np.random.default_rng(0)
    for trial in range(2000):
        clients = np.unique(rng.integers(0, 100, int(rng.integers(0, 60))))
        taken = rng.integers(0, 110, int(rng.integers(0, 8)))
        assert np.array_equal(_not_among(clients, taken), ~np.isin(clients, taken))
        keys = rng.integers(0, 5, len(clients)).astype(float) if trial % 2 else rng.random(len(clients))
        count = int(rng.integers(0, len(clients) + 3))
        assert np.array_equal(_first_in_order(keys, count), np.argsort(keys, kind="stable")[:count])
