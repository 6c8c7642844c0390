"""Checks every numeric option gets, whatever it is: a finite float, a seed in the range every generator takes.

Without them ``--lam inf`` or ``--gamma nan`` reach torch's solvers (an
"INTERNAL ASSERT FAILED" deep in lstsq) and ``--seed -1`` reaches numpy ("expected
non-negative integer") only once the work has begun. They apply by the value's
type and the option's name, so a new option gets them without a line of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from fedray.core.errors import FedrayError

MAX_SEED = 2**63 - 1
"""numpy takes any seed ≥ 0 and torch any below 2⁶⁴; the metrics table stores seeds as int64."""


def is_seed(key: str) -> bool:
    return key == "seed" or key.endswith("_seed")


def check_numeric_option(option: str, key: str, value: object) -> None:
    """``value`` of the option ``key`` (``option``: as the user spelled it) is finite and, for a seed, in range."""
    if isinstance(value, float) and not math.isfinite(value):
        raise FedrayError(f"{option} must be a finite number, got {value}")
    if is_seed(key) and isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_SEED:
        raise FedrayError(f"{option} must be an integer from 0 to 2^63 - 1, got {value}")


def check_numeric_options(values: Mapping[str, object], spelled: Callable[[str], str]) -> None:
    """:func:`check_numeric_option` on every entry; ``spelled(key)`` is the option as the user typed it."""
    for key, value in values.items():
        check_numeric_option(spelled(key), key, value)


def command_line(key: str) -> str:
    """``clients_per_round`` as typed on the command line: ``--clients-per-round``."""
    return "--" + key.replace("_", "-")


def check_positive(values: dict[str, object]) -> None:
    """Each of ``values`` (option name: value) that is set is > 0, else a one-line error naming its flag."""
    for name, value in values.items():
        if value is not None and value <= 0:
            raise FedrayError(f"{command_line(name)} must be > 0, got {value}")
