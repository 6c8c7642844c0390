"""ε(δ) for the DP postprocessors (``dp``, ``dp-fedavg``), from Google's ``dp-accounting``, and the noise multiplier
calibrated to a budget.

One default accountant for both, the PLD one (privacy loss distributions: near exact for Gaussian mechanisms, within
7e-4 of prv_accountant's ε); the RDP one on request (``dp_accountant=rdp``; Opacus's and TF Privacy's, looser, and the
only one of the two that accounts fixed-size sampling).

**PLD's discretization** is chosen from the ε it resolves: the loss values are rounded up (pessimistically) to a grid
of step 1e-3, or finer for a small ε, the power of ten at most ε/1000 (:func:`pld_interval`): at step 1e-3 an ε of 0.05
(q = 0.001, σ = 2, 1000 rounds) reads 0.064. :func:`spent` computes at 1e-3, then again at the step the ε found asks
for, until it asks for no finer one: the same σ gives the same ε whether it was calibrated or given.

**RDP's orders** are dp-accounting's defaults (1.1 to 10.9 by tenths, 11 to 63, 128 to 1024). At a few small fractional
orders (1.1 up to about 2.4, depending on q and σ) the library's series for the subsampled Gaussian does not converge;
it leaves those orders out (ε is the minimum over the others, still an upper bound) and logs a warning for each, which
:func:`spent` keeps off the console. Where ε is large (the best order below 2) the orders left out make ε up to ~30 %
above Opacus's, which sums the series further. Every RDP row says which orders its ε was minimized over
(``dp_rdp_orders``, :func:`rdp_orders`): ``1.9-1024`` where 1.1 to 1.8 were left out, ``1.1-1024`` where none was.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # dp-accounting (and the scipy it loads) is imported when an ε is first computed: a run's options
    import dp_accounting  # name these postprocessors, which every fedray command reads, and most runs use no DP

PLD, RDP = "pld", "rdp"
ACCOUNTANTS = (PLD, RDP)
DEFAULT_ACCOUNTANT = PLD
NOISE_RANGE = (0.1, 1000.0)
"""The noise multipliers a budget is calibrated within: above the upper end no run learns anything."""
COARSEST_INTERVAL = 1e-3
FINEST_INTERVAL = 1e-9
CALIBRATION_TOLERANCE = 1e-6
"""σ is calibrated to within this of the smallest multiplier that meets the budget (dp-accounting's own tolerance)."""
ADD_OR_REMOVE, REPLACE = "ADD_OR_REMOVE_ONE", "REPLACE_ONE"
"""Neighbouring data sets (``dp_accounting.NeighboringRelation``'s members, by name): one record added or removed, or
one replaced."""

Event = Callable[[float], "dp_accounting.DpEvent"]
"""A mechanism as the accountant sees it, for a noise multiplier."""


def pld_interval(epsilon: float) -> float:
    """PLD's value discretization for an ε about ``epsilon``: 1e-3, or the largest power of ten at most ε/1000 below
    it (no finer than 1e-9), so that the rounding adds about 0.1 % to a small ε."""
    if not 0 < epsilon < math.inf:
        return COARSEST_INTERVAL
    return min(COARSEST_INTERVAL, max(FINEST_INTERVAL, 10.0 ** math.floor(math.log10(epsilon / 1000))))


class _Unconverged(logging.Filter):
    """Drops dp-accounting's "failed to converge" warnings (an RDP order left out of ε, as documented above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@contextmanager
def _quiet_library() -> Iterator[None]:
    """dp-accounting's absl warnings off the console while it accounts here, and only those."""
    library = logging.getLogger("absl")
    unconverged = _Unconverged()
    library.addFilter(unconverged)
    try:
        yield
    finally:
        library.removeFilter(unconverged)


def _composed(event: dp_accounting.DpEvent, kind: str, relation: str,
              interval: float = COARSEST_INTERVAL) -> dp_accounting.PrivacyAccountant:
    """``kind``'s accountant under ``relation`` (PLD at the discretization ``interval``) with ``event`` composed,
    without dp-accounting's log lines."""
    import dp_accounting

    neighbours = dp_accounting.NeighboringRelation[relation]
    accountant = (dp_accounting.pld.PLDAccountant(neighbours, value_discretization_interval=interval) if kind == PLD
                  else dp_accounting.rdp.RdpAccountant(neighboring_relation=neighbours))
    with _quiet_library():
        accountant.compose(event)
    return accountant


def _epsilon(event: dp_accounting.DpEvent, delta: float, kind: str, relation: str, interval: float) -> float:
    accountant = _composed(event, kind, relation, interval)
    with _quiet_library():
        return float(accountant.get_epsilon(delta))


def spent(event: dp_accounting.DpEvent, delta: float, kind: str = DEFAULT_ACCOUNTANT,
          relation: str = ADD_OR_REMOVE) -> float:
    """ε(δ) of ``event`` from ``kind``'s accountant under ``relation`` (PLD: at the discretization its ε asks for)."""
    interval = COARSEST_INTERVAL
    epsilon = _epsilon(event, delta, kind, relation, interval)
    while kind == PLD and (finer := pld_interval(epsilon)) < interval:
        interval, epsilon = finer, _epsilon(event, delta, kind, relation, finer)
    return epsilon


def rdp_orders(event: dp_accounting.DpEvent, relation: str = ADD_OR_REMOVE) -> str:
    """The RDP orders the RDP accountant minimizes ``event``'s ε over under ``relation``: dp-accounting's default
    orders but those where its series did not converge (or the RDP is infinite), as :func:`order_ranges` writes
    them."""
    accountant = _composed(event, RDP, relation)
    return order_ranges(accountant.orders, np.isfinite(accountant.rdp))


def order_ranges(orders: Sequence[float], used: Sequence[bool]) -> str:
    """The ``used`` ones of ``orders`` as runs of consecutive entries, first-last, joined by commas (``1.9-1024``,
    ``1.1-1.3,1.6-1024``, ``none``)."""
    runs = []
    for kept, run in itertools.groupby(zip(orders, used), key=lambda pair: bool(pair[1])):
        if kept:
            consecutive = [float(order) for order, _ in run]
            first, last = consecutive[0], consecutive[-1]
            runs.append(f"{first:g}" if len(consecutive) == 1 else f"{first:g}-{last:g}")
    return ",".join(runs) or "none"


def calibrated(epsilon_of: Callable[[float], float], target: float, refusal: str) -> float:
    """The smallest noise multiplier in :data:`NOISE_RANGE` (to within :data:`CALIBRATION_TOLERANCE`) whose
    ``epsilon_of`` is at most ``target``; a ``ValueError`` of ``refusal`` (formatted with ``high`` and ``spent``) when
    none is."""
    import scipy.optimize

    low, high = NOISE_RANGE
    if epsilon_of(high) > target:
        raise ValueError(refusal.format(high=high, spent=epsilon_of(high)))
    if epsilon_of(low) <= target:
        return low
    noise = float(scipy.optimize.brentq(lambda noise: epsilon_of(noise) - target, low, high,
                                        xtol=CALIBRATION_TOLERANCE))
    while epsilon_of(noise) > target:  # brentq's root is within its tolerance of a crossing, on either side
        noise += CALIBRATION_TOLERANCE
    return noise
