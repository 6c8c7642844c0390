"""The DP postprocessors' accountants against independent ones: PLD against Microsoft's prv_accountant (the PRV
accountant, Gopi et al. 2021), RDP against Opacus's; PLD's discretization chosen from the ε it resolves (a small ε is
not over-stated); RDP without dp-accounting's log lines, naming the orders its ε was minimized over; the calibrated σ
the smallest that meets its budget."""

import logging
import math

import dp_accounting
import pytest
from opacus.accountants.analysis import rdp as opacus_rdp

from fedray.postprocessors.accounting import order_ranges, rdp_orders, spent
from fedray.postprocessors.dp_fedavg import calibrated, epsilon

DELTA = 1e-5
OPACUS_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
"""Opacus's ``RDPAccountant`` default orders."""
LIBRARY_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
"""dp-accounting's default orders."""


PRV_EPSILON = {
    (9275, 100, 0.7, 300): 3.265595733570311,
    (9275, 100, 1.5, 300): 0.5384568072403381,
    (100, 5, 0.7, 6): 3.542599721117968,
    (100, 5, 0.5, 6): 7.555234892277154,
    (1000, 1, 2.0, 1000): 0.04998730018075964,
    (1000, 10, 3.0, 100): 0.11238869868718526,
}
"""ε(δ = 1e-5) of ``rounds`` Poisson-subsampled Gaussian mechanisms of sampling rate per_round / population and noise
multiplier σ, by (population, per_round, σ, rounds): prv_accountant 0.2.0's estimate (``PRVAccountant`` of
``PoissonSubsampledGaussianMechanism(σ, q)``, eps_error 1e-4, delta_error 1e-8; ``compute_epsilon``'s middle value),
written out: each took 10 s to a minute of CPU."""


def opacus_epsilon(q: float, noise: float, rounds: int, orders: list[float] = OPACUS_ORDERS) -> float:
    """Opacus's RDP accountant (by default its default orders), as its ``RDPAccountant.get_epsilon`` computes it."""
    rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=noise, steps=rounds, orders=orders)
    return float(opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=DELTA)[0])


def poisson(noise: float, kind: str, population: int, per_round: int, rounds: int) -> float:
    return epsilon(noise, DELTA, kind, "poisson", population, per_round, rounds)


@pytest.mark.parametrize("population, per_round, noise, rounds", [
    (9275, 100, 0.7, 300),  # iNat-120K's q, ε ≈ 3.3
    (9275, 100, 1.5, 300),  # ε ≈ 0.54
    (100, 5, 0.7, 6),       # q = 0.05, ε ≈ 3.5
    (100, 5, 0.5, 6),       # ε ≈ 7.6
])
def test_pld_agrees_with_prv_accountant_where_epsilon_is_at_least_a_half(population, per_round, noise, rounds):
    reference = PRV_EPSILON[population, per_round, noise, rounds]
    assert reference >= 0.5
    assert abs(poisson(noise, "pld", population, per_round, rounds) - reference) <= 7e-4


@pytest.mark.parametrize("population, per_round, noise, rounds", [(1000, 1, 2.0, 1000), (1000, 10, 3.0, 100)])
def test_a_small_epsilon_is_not_overstated_by_plds_discretization(population, per_round, noise, rounds):
    """ε ≈ 0.050 and 0.112: at a fixed discretization of 1e-3 PLD read 0.064 (29 % over) and 0.113; within 0.5 %."""
    reference = PRV_EPSILON[population, per_round, noise, rounds]
    assert reference < 0.2
    assert poisson(noise, "pld", population, per_round, rounds) == pytest.approx(reference, rel=5e-3)


@pytest.mark.parametrize("population, per_round, noise, rounds", [
    (9275, 100, 0.7, 300), (9275, 100, 1.5, 300), (100, 5, 0.5, 6), (1000, 10, 1.0, 1000), (100, 10, 0.9, 50),
])
def test_rdp_agrees_with_opacus_where_epsilon_is_at_most_25(population, per_round, noise, rounds):
    reference = opacus_epsilon(per_round / population, noise, rounds)
    assert reference <= 25
    assert poisson(noise, "rdp", population, per_round, rounds) == pytest.approx(reference, rel=4e-3)


def test_rdps_orders_that_do_not_converge_are_left_out_without_a_log_line(caplog):
    """q = 0.05, σ = 0.5: dp-accounting's series does not converge at orders 1.1 to 1.5 and logs a warning for each;
    none reaches a handler, and ε is still Opacus's (the best order is above them)."""
    with caplog.at_level(logging.DEBUG):
        spent = poisson(0.5, "rdp", 100, 5, 7)
    assert caplog.records == []
    assert spent == pytest.approx(opacus_epsilon(0.05, 0.5, 7), rel=4e-3)


def test_rdp_names_the_orders_its_epsilon_was_minimized_over():
    """q = 0.5, σ = 0.5, 50 rounds (ε ≈ 112): dp-accounting's series does not converge at orders 1.1 to 1.6. Its ε is
    Opacus's over the orders it names; Opacus's over all of them (its series converges; best order 1.4) is 19 % less.
    A Gaussian's RDP is finite at every order."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(0.5)), 50)
    assert rdp_orders(event) == "1.7-1024"
    named = [order for order in LIBRARY_ORDERS if order >= 1.7]
    library = spent(event, DELTA, "rdp")
    with pytest.warns(UserWarning, match="Optimal order is the smallest alpha"):  # 1.7: the best lies below
        assert library == pytest.approx(opacus_epsilon(0.5, 0.5, 50, named), rel=1e-3)
    assert opacus_epsilon(0.5, 0.5, 50, LIBRARY_ORDERS) < 0.85 * library
    assert rdp_orders(dp_accounting.GaussianDpEvent(0.5)) == "1.1-1024"


def test_orders_are_written_as_runs_of_consecutive_ones():
    assert order_ranges([1.1, 1.2, 1.3, 2.0, 3.0, 4.0], [False, True, False, True, True, True]) == "1.2,2-4"
    assert order_ranges([1.1, 2.0], [False, False]) == "none"


@pytest.mark.parametrize("epsilon_value, interval", [(math.inf, 1e-3), (4.0, 1e-3), (0.5, 1e-4), (0.05, 1e-5),
                                                     (1e-20, 1e-9)])
def test_plds_interval_is_a_power_of_ten_at_most_a_thousandth_of_epsilon(epsilon_value, interval):
    from fedray.postprocessors import accounting

    assert accounting.pld_interval(epsilon_value) == interval


@pytest.mark.parametrize("kind, target", [("pld", 0.3), ("pld", 4.0), ("rdp", 4.0)])
def test_the_calibrated_noise_is_the_smallest_that_meets_its_budget(kind, target):
    noise = calibrated(target, DELTA, kind, "poisson", 1000, 10, 200)
    assert poisson(noise, kind, 1000, 10, 200) <= target
    assert poisson(noise - 2e-5, kind, 1000, 10, 200) > target


def test_the_dp_postprocessors_load_the_accountant_only_to_account():
    """Every fedray command reads the DP postprocessors' flags: loading them costs no dp-accounting (nor its scipy)."""
    import subprocess
    import sys

    script = ("import sys, fedray.postprocessors.dp, fedray.postprocessors.dp_fedavg; "
              "print(sorted({'dp_accounting', 'scipy.optimize'} & sys.modules.keys()))")
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"
