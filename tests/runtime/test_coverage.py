"""Rounds needed to see 25/50/75/100% of the clients (Fed3R's Table 7 setting: K = 9,275 and 1,262).

With κ distinct clients per round, drawn afresh every round, a given client is
still unseen after r rounds with probability q^r, q = 1 − κ/K. The expected
number of rounds to see everyone is Σ_r P(not all seen after r) ≈
Σ_r 1 − (1 − q^r)^K, and a fraction f < 1 is reached after about
ln(1 − f) / ln q rounds. The simulated means must agree with these within
their standard errors, and their spread with the Gumbel limit π / (√6 · |ln q|).
"""

import math

import numpy as np
import pytest

from fedray.runtime.sampling import coverage

TRIALS = 200


def expected_rounds_to_see_all(num_clients: int, per_round: int) -> float:
    q = 1 - per_round / num_clients
    r = np.arange(0, 200 * num_clients // per_round)
    return float(np.sum(1 - (1 - q**r) ** num_clients))


@pytest.mark.parametrize("num_clients", [pytest.param(9275, marks=pytest.mark.slow), 1262])
@pytest.mark.parametrize("per_round", [10, 20, 50])
def test_coverage_with_replacement_matches_the_sampling_law(num_clients, per_round):
    result = coverage(num_clients, per_round, replacement=True, trials=TRIALS, seed=0)
    q = 1 - per_round / num_clients
    gumbel_std = math.pi / (math.sqrt(6) * -math.log(q))
    mean_all, std_all = result[1.0]
    assert abs(mean_all - expected_rounds_to_see_all(num_clients, per_round)) <= 4 * gumbel_std / math.sqrt(TRIALS)
    assert 0.6 * gumbel_std <= std_all <= 1.5 * gumbel_std
    for fraction in (0.25, 0.5, 0.75):
        mean, std = result[fraction]
        assert abs(mean - math.log(1 - fraction) / math.log(q)) <= max(2.0, 0.01 * mean)
        assert std < 0.05 * mean_all


def test_coverage_without_replacement_is_exact():
    result = coverage(9275, 10, replacement=False, trials=3, seed=0)
    assert result == {0.25: (232.0, 0.0), 0.5: (464.0, 0.0), 0.75: (696.0, 0.0), 1.0: (928.0, 0.0)}
