"""The clock's counter-based random numbers: a plain reference of the hash, layout independence, distributions."""

import numpy as np
import pytest
from scipy import stats

from fedray.clock.streams import lognormal_factors, normals, uniforms
from fedray.core.errors import FedrayError

MASK = 2**64 - 1


def mix(x: int) -> int:
    """SplitMix64's finalizer on a Python int."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def reference_uniform(seed: int, stream: int, client: int, round_: int, draw: int) -> float:
    """The documented hash, written out: absorb seed, stream, draw, client, round, each as mix((word ^ v)·γ + γ);
    the top 52 bits k give (k + ½)·2⁻⁵²."""
    gamma = 0x9E3779B97F4A7C15
    word = 0
    for value in (seed, stream, draw, client, round_):
        word = mix(((word ^ value) * gamma + gamma) & MASK)
    return ((word >> 12) + 0.5) / 2**52


def test_the_hash_is_the_documented_one():
    cases = [(0, 0, 0, 0, 0), (7, 40, 123_456, 3, 0), (2**63 - 1, 41, 10**9, 2**40, 2), (1, 47, 5, 0, 1)]
    for seed, stream, client, round_, draw in cases:
        expected = reference_uniform(seed, stream, client, round_, draw)
        assert uniforms(seed, stream, np.array([client]), round_, draw)[0] == expected


def test_a_clients_number_does_not_depend_on_the_others_in_the_call_or_their_order():
    clients = np.arange(5_000)
    whole = uniforms(11, 42, clients, round=9)
    rng = np.random.default_rng(0)
    some = rng.permutation(clients)[:700]
    assert np.array_equal(uniforms(11, 42, some, round=9), whole[some])
    assert uniforms(11, 42, np.array([4_321]), round=9)[0] == whole[4_321]
    assert np.array_equal(uniforms(11, 42, clients.astype(np.uint32), round=9), whole)


def test_rounds_broadcast_like_one_call_per_round():
    clients = np.arange(50)
    rounds = np.array([0, 1, 2, 7])[:, None]
    table = uniforms(3, 47, clients, rounds)
    assert table.shape == (4, 50)
    for row, round_ in enumerate([0, 1, 2, 7]):
        assert np.array_equal(table[row], uniforms(3, 47, clients, round_))


def test_draws_in_one_call_are_one_call_a_draw():
    clients = np.array([5, 0, 17])
    together = lognormal_factors(np.array([[0.5, 0.1, 0.0], [1.0, 2.0, 3.0]]), 9, 41, clients, 4, (1, 2))
    assert together.tolist() == [lognormal_factors(np.array([0.5, 0.1, 0.0]), 9, 41, clients, 4, 1).tolist(),
                                 lognormal_factors(np.array([1.0, 2.0, 3.0]), 9, 41, clients, 4, 2).tolist()]


@pytest.mark.parametrize("vary", ["clients", "rounds"])
def test_uniform_on_the_open_unit_interval(vary):
    """Kolmogorov-Smirnov against U(0, 1) at a fixed seed, over consecutive clients (one round) or consecutive rounds
    (one client): D below the α = 0.001 critical value 1.949 / √n, which a uniform generator passes 999 times in
    1000."""
    n = 100_000
    values = uniforms(5, 40, np.arange(n)) if vary == "clients" else uniforms(5, 40, np.array([17]), np.arange(n))
    assert values.min() > 0 and values.max() < 1
    assert stats.kstest(values, "uniform").statistic < 1.949 / np.sqrt(n)


def test_neighbouring_inputs_are_uncorrelated():
    """Adjacent clients, adjacent rounds, adjacent streams, adjacent seeds and two draws: |correlation| under 4/√n
    (four standard errors of a correlation of independent samples)."""
    n = 100_000
    clients = np.arange(n)
    base = uniforms(5, 40, clients, 3)
    for other in (uniforms(5, 40, clients + 1, 3), uniforms(5, 40, clients, 4), uniforms(5, 41, clients, 3),
                  uniforms(6, 40, clients, 3), uniforms(5, 40, clients, 3, draw=1)):
        assert abs(np.corrcoef(base, other)[0, 1]) < 4 / np.sqrt(n)


def test_normals_and_lognormal_factors():
    n = 100_000
    z = normals(9, 41, np.arange(n), 2)
    assert stats.kstest(z, "norm").statistic < 1.949 / np.sqrt(n)
    factors = lognormal_factors(0.5, 9, 41, np.arange(n), 2)
    assert np.array_equal(factors, np.exp(0.5 * z))
    assert abs(np.median(factors) - 1) < 0.01  # median 1: the median of exp(σz) is exp(0)
    assert np.all(lognormal_factors(0.0, 9, 41, np.arange(n), 2) == 1.0)
    per_client = lognormal_factors(np.array([0.0, 1.0]), 9, 41, np.array([3, 4]), 2)
    assert per_client[0] == 1.0 and per_client[1] == np.exp(z[4])


def test_a_million_clients_draw_in_one_call_each_its_own_value():
    """Vectorised over the clients (its speed is jobs.bench_scale --clock's): client k's draw is the one it gets alone."""
    clients = np.arange(1_000_000)
    values = uniforms(1, 40, clients, 12)
    assert values.shape == (1_000_000,) and np.all((values >= 0) & (values < 1))
    for k in (0, 1, 999_999):
        assert values[k] == uniforms(1, 40, np.array([k]), 12)[0]


@pytest.mark.parametrize("arguments, message", [
    ((-1, 40, [0]), "seed"), ((2**63, 40, [0]), "seed"), ((0, -2, [0]), "stream must be ≥ 0"),
    ((0, 40, [3, -1]), "client ids must be ≥ 0"), ((0, 40, [0.5]), "client ids must be integers"),
    ((0, 40, [0], -1), "round must be ≥ 0"),
])
def test_bad_input_is_one_line(arguments, message):
    with pytest.raises(FedrayError, match=message):
        uniforms(*arguments)


def test_no_clients_no_numbers():
    assert uniforms(0, 40, []).shape == (0,)
