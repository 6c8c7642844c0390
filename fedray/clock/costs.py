"""What a client's task asks of its device: multiply-adds to compute and bytes to move, the clock's one unit of work.

The engine fills a :class:`TaskCost` from what fedray already accounts (a closed-form client's statistics, local
epochs, the backbone's forward and backward passes where known, the upload and download sizes, SecAgg's masks and
key exchange); a device model turns it into seconds (:mod:`fedray.clock.devices`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from fedray.core.errors import FedrayError, shown

Amount = float | np.ndarray
"""One amount for every client, or a float64 array of one per client."""


@dataclass(frozen=True)
class TaskCost:
    """A task's multiply-adds, bytes downloaded and bytes uploaded: each a float or a float64 array (one per client,
    in the clients' order), all ≥ 0 and finite, their shapes broadcastable together."""

    macs: Amount = 0.0
    down_bytes: Amount = 0.0
    up_bytes: Amount = 0.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if type(value) is float and 0 <= value < math.inf:  # a round's amount for all: the check at no cost
                continue
            amount = np.asarray(value, dtype=np.float64) if _numeric(value) else None
            if amount is None or not (np.isfinite(amount).all() and (amount >= 0).all()):
                raise FedrayError(f"TaskCost: {field.name} must be finite numbers ≥ 0, got {shown(value)}")
            object.__setattr__(self, field.name, float(amount) if amount.ndim == 0 else amount)
        try:
            np.broadcast_shapes(*(np.shape(getattr(self, field.name)) for field in fields(self)))
        except ValueError:
            shapes = ", ".join(f"{field.name} {np.shape(getattr(self, field.name))}" for field in fields(self))
            raise FedrayError(f"TaskCost: the amounts' shapes do not match ({shapes})") from None

    def __add__(self, other: TaskCost) -> TaskCost:
        """Both tasks' work, amount by amount (one task after the other on the same device)."""
        if not isinstance(other, TaskCost):
            return NotImplemented
        return TaskCost(*(getattr(self, field.name) + getattr(other, field.name) for field in fields(self)))


def _numeric(value: object) -> bool:
    """Whether ``value`` is a real number or an array of them (a bool is not an amount)."""
    kind = np.asarray(value).dtype.kind
    return kind in "iuf" and not isinstance(value, bool)
