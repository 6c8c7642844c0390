"""What the selectors and the round scheduler ask of an availability model: two vectorised, stateless lookups."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class AvailabilityLookup(Protocol):
    """Who is online when, for many clients at once (an availability model of ``fedray.clock``)."""

    def available(self, clients: np.ndarray, t: float) -> np.ndarray:
        """Whether each of ``clients`` is online at virtual time ``t``: a bool array."""
        ...

    def stays_available(self, clients: np.ndarray, t0: float, t1: np.ndarray) -> np.ndarray:
        """Whether each of ``clients`` is online during the whole of [t0, t1) (its own t1): a bool array."""
        ...
