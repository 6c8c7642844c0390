"""An Oort-style client selector in one file (Lai et al., "Oort: Efficient Federated Learning via Guided Participant
Selection", OSDI 2021).

    fedray run --method fedavg --selector examples/oort_selector.py:Oort --over-commit 1.3 ...

A round asks n clients. A client the server has heard from (an explored one) is worth

    U_i = |B_i| · sqrt(mean of its samples' loss²)             its statistical utility, from its last upload
        × (T / t_i)^α        where t_i > T                      a penalty for being slower than the preferred duration

where t_i is its last round's duration and T the ``round_threshold``-th percentile of the known durations; B_i are
the client's training samples, each sample's loss taken at the model its last round sent (``uses_utility`` below asks
the run to measure them: round r is then picked after round r − 1 has trained, from the losses it measured). A
fraction ε = max(ε₀ · decay^(r + 1), ε_min) of the n (rounded down) explores: drawn uniformly among the online clients
never heard from; the rest exploit: the online explored clients of the highest U (ties by client id). Whichever side
runs short, the other fills. The defaults are the paper's (FedScale's): α = 2, T at the 30th percentile, ε from 0.9,
× 0.98 a round, down to 0.3.

Simpler than Oort itself: no confidence bonus for a client not chosen for a while, no pacer moving T, and
exploitation takes the top of the ranking where Oort samples by utility among the clients above a cut-off. Like
Oort's, a round costs O(K) (it ranks every explored client).
"""

from dataclasses import dataclass
from typing import Annotated

import numpy as np

import fedray


@dataclass(frozen=True)
class Oort(fedray.Selector):
    uses_utility = True  # the run measures each client's losses, and picks a round after the one before has trained

    round_penalty: Annotated[float, "α: a slow client's utility × (T / t)^α"] = 2.0
    round_threshold: Annotated[float, "T, the preferred round duration, as a percentile of the known durations"] = 30.0
    exploration_factor: Annotated[float, "ε₀, the share of a round that explores at the start"] = 0.9
    exploration_decay: Annotated[float, "ε's factor a round"] = 0.98
    exploration_min: Annotated[float, "ε's floor"] = 0.3

    def __post_init__(self) -> None:
        if not 0 <= self.round_threshold <= 100:
            raise fedray.FedrayError(f"--round-threshold is a percentile from 0 to 100, got {self.round_threshold}")
        if not 0 <= self.exploration_min <= self.exploration_factor <= 1 or not 0 < self.exploration_decay <= 1:
            raise fedray.FedrayError("Oort needs 0 ≤ exploration_min ≤ exploration_factor ≤ 1 and 0 < "
                                     "exploration_decay ≤ 1")

    def exploration(self, round: int) -> float:
        return max(self.exploration_factor * self.exploration_decay ** (round + 1), self.exploration_min)

    def utility(self, history: fedray.ClientHistory, clients: np.ndarray) -> np.ndarray:
        """U of each of ``clients`` (explored ones): statistical utility (0 where the run reports none) × penalty."""
        known = history.duration_s[np.isfinite(history.duration_s)]
        preferred = np.sort(known)[min(int(len(known) * self.round_threshold / 100), len(known) - 1)] \
            if len(known) else np.inf
        duration = history.duration_s[clients]
        slow = duration > preferred
        penalty = np.ones(len(clients))
        penalty[slow] = (preferred / duration[slow]) ** self.round_penalty
        return np.nan_to_num(history.utility[clients]) * penalty

    def select(self, context: fedray.RoundContext) -> np.ndarray:
        wanted, history = context.wanted, context.history
        explored = np.flatnonzero(history.rounds > 0)
        explored = explored[context.online(explored)]
        exploit = min(wanted - int(wanted * self.exploration(context.round)), len(explored))
        explore = context.draw_online(wanted - exploit, eligible=lambda clients: history.rounds[clients] == 0)
        exploit = min(wanted - len(explore), len(explored))
        best = np.lexsort((explored, -self.utility(history, explored)))[:exploit]
        return np.concatenate((explored[best], explore))
