import math

import numpy as np
import pytest
from scipy import stats

from fedray.clock.markov import MarkovAvailability
from fedray.clock.streams import uniforms
from fedray.core.errors import FedrayError

ON, OFF, SEED = 60.0, 140.0, 11
CLIENTS = np.arange(50)


def ticks(client: int, blocks: int) -> list[tuple[float, bool]]:
    """The client's clock ticks and the state each draws, as the module's docstring builds them, block by block: the
    uniformised process, rate λ = 1/ON + 1/OFF, blocks of length 1/λ, gap and state of tick ``slot`` of block k from
    counters k·2³² + 2 + 2·slot and k·2³² + 3 + 2·slot."""
    block_s = 1.0 / (1.0 / ON + 1.0 / OFF)
    listed = []
    for block in range(blocks):
        position, slot = block * block_s, 0
        while True:
            counter = np.array([block * 2**32 + 2 + 2 * slot], dtype=np.uint64)
            position += float(-np.log1p(-uniforms(SEED, 42, np.array([client]), counter)[0]) * block_s)
            if position >= (block + 1) * block_s:
                break
            state = uniforms(SEED, 42, np.array([client]), counter + np.uint64(1))[0] < ON / (ON + OFF)
            listed.append((position, bool(state)))
            slot += 1
    return listed


def reference(client: int, listed: list[tuple[float, bool]], t: float) -> tuple[bool, float, float]:
    """(available, next_available, online_until) at t, scanning the ticks in order."""
    online = bool(uniforms(SEED, 42, np.array([client]), 0)[0] < ON / (ON + OFF))
    for position, state in listed:
        if position <= t:
            online = state
    change = next(position for position, state in listed if position > t and state != online)
    return online, t if online else change, change if online else t


def test_lookups_match_the_ticks_listed_one_by_one():
    model = MarkovAvailability(markov_on_s=ON, markov_off_s=OFF, seed=SEED)
    for client in CLIENTS:
        listed = ticks(client, blocks=60)
        horizon = 40 * model.block_s
        edges = [position for position, _ in listed if position < horizon]
        times = np.array([0.0, 1.0, horizon / 2, *edges, *np.nextafter(edges, np.inf), *np.nextafter(edges, -np.inf)])
        ids = np.full(times.size, client)
        expected = [reference(client, listed, t) for t in times]
        assert model.available(ids, times).tolist() == [online for online, _, _ in expected]
        assert model.next_available(ids, times).tolist() == [moment for _, moment, _ in expected]
        assert model.online_until(ids, times).tolist() == [until for _, _, until in expected]


def test_intervals_are_half_open():
    model = MarkovAvailability(markov_on_s=ON, markov_off_s=OFF, seed=SEED)
    clients = CLIENTS
    start = model.next_available(clients, 500.0)
    end = model.online_until(clients, start)
    assert np.all(start >= 500.0) and np.all(end > start)
    assert model.available(clients, start).all()
    assert not model.available(clients, end).any()
    assert model.stays_available(clients, start, end).all()
    assert not model.stays_available(clients, start, np.nextafter(end, np.inf)).any()
    assert model.available(clients, np.nextafter(end, -np.inf)).all()


def test_a_new_seed_is_a_new_realisation():
    times = np.full(2000, 1000.0)
    first = MarkovAvailability(markov_on_s=ON, markov_off_s=OFF, seed=1).next_available(np.arange(2000), times)
    second = MarkovAvailability(markov_on_s=ON, markov_off_s=OFF, seed=2).next_available(np.arange(2000), times)
    assert np.mean(first == second) < 0.5


def periods(model: MarkovAvailability, clients: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``count`` online or offline periods of each client from t = 0 (the first one cut at 0: memoryless,
    it has the law of a whole one), walked with next_available and online_until: (online ones, offline ones)."""
    on, off = [], []
    t = np.zeros(clients.size)
    online = model.available(clients, t)
    for _ in range(count):
        change = np.where(online, model.online_until(clients, t), model.next_available(clients, t))
        on.append((change - t)[online])
        off.append((change - t)[~online])
        t, online = change, ~online
    return np.concatenate(on), np.concatenate(off)


def test_the_long_run_matches_the_process():
    """4,000 clients' first 20 periods: 40,000 online and 40,000 offline ones. The means' standard errors are
    ON/√40,000 = 0.5 %: tolerances of 3 % are 6 standard errors. The periods follow the exponential law
    (Kolmogorov-Smirnov on 2,000 of each; at this seed p ≫ 10⁻³). At any moment p = ON / (ON + OFF) = 0.3 of 20,000
    clients are online (standard error 0.0032; tolerance 0.015)."""
    model = MarkovAvailability(markov_on_s=ON, markov_off_s=OFF, seed=SEED)
    on, off = periods(model, np.arange(4000), 20)
    assert on.size + off.size == 80_000 and abs(on.size - off.size) <= 4000
    assert np.mean(on) == pytest.approx(ON, rel=0.03)
    assert np.mean(off) == pytest.approx(OFF, rel=0.03)
    assert stats.kstest(on[:2000], "expon", args=(0, ON)).pvalue > 1e-3
    assert stats.kstest(off[:2000], "expon", args=(0, OFF)).pvalue > 1e-3
    for t in (0.0, 1e4, 1e6):
        assert model.available(np.arange(20_000), t).mean() == pytest.approx(0.3, abs=0.015)


def test_rounds_that_fill_at_fewer_than_one_moment_in_a_million_are_refused():
    model = MarkovAvailability(markov_on_s=1.0, markov_off_s=1.0)
    # P(Binomial(100, 1/2) ≥ κ) summed plainly: the first κ where it falls below 10⁻⁶
    tail = {k: sum(math.comb(100, i) for i in range(k, 101)) / 2**100 for k in range(1, 101)}
    first_refused = min(k for k in tail if tail[k] < 1e-6)
    assert 70 < first_refused < 80
    model.check_rounds_can_fill(first_refused - 1, 100)
    with pytest.raises(FedrayError, match=f"keeps 0.5 of the 100 clients online .50.0 on average.: a round of "
                                          f"{first_refused} fills at fewer than 1e-06 of moments"):
        model.check_rounds_can_fill(first_refused, 100)
    with pytest.raises(FedrayError, match="a round of 101 clients cannot fill from a population of 100"):
        model.check_rounds_can_fill(101, 100)


@pytest.mark.parametrize("options, message", [
    ({"markov_on_s": 0.0}, "--markov-on-s must be > 0, got 0.0"),
    ({"markov_off_s": -1.0}, "--markov-off-s must be > 0, got -1.0"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(FedrayError, match=message):
        MarkovAvailability(**options)


def test_lookups_beyond_the_reach_of_the_counters_are_refused():
    model = MarkovAvailability(markov_on_s=1.0, markov_off_s=1.0)
    with pytest.raises(FedrayError, match="--availability markov: lookups reach 2.15e\\+09 virtual seconds at most"):
        model.available(np.arange(3), 1e10)
