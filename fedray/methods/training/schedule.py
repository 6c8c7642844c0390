"""The client learning rate of each training round: constant, cosine over the run's rounds, or step decay.

Round t (1-based; a closed-form initialization's rounds do not count) uses
η · factor(t) with

- ``constant``: 1;
- ``cosine``: (1 + cos(π (t − 1) / T)) / 2 with T the run's ``--rounds``:
  torch's ``CosineAnnealingLR(T_max=T, eta_min=0)`` stepped once per round,
  so round 1 trains at η and the last at nearly 0. SphereFed (Section 5.1)
  "decay[s] the learning rate every round using a cosine annealing
  schedule" over its 100 rounds: the schedule spans the whole run, not one
  client's local steps;
- ``step``: γ^(number of milestones m < t): torch's ``MultiStepLR`` stepped
  once per round, so from round m + 1 on the rate is multiplied by γ.

Within a round every client uses the round's rate for all its local steps.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Literal

ScheduleKind = Literal["constant", "cosine", "step"]
SCHEDULES: tuple[str, ...] = typing.get_args(ScheduleKind)


@dataclass(frozen=True)
class LrSchedule:
    kind: str = "constant"
    rounds: int = 1
    """T, the rounds the cosine spans."""
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1

    def factor(self, round_number: int) -> float:
        """The multiplier of the base learning rate in training round ``round_number`` (1-based)."""
        if self.kind == "cosine":
            return (1 + math.cos(math.pi * (round_number - 1) / self.rounds)) / 2
        if self.kind == "step":
            return self.gamma ** sum(milestone < round_number for milestone in self.milestones)
        return 1.0


def parse_milestones(text: str | None) -> tuple[int, ...]:
    """``"50,75"`` as (50, 75); ValueError when an entry is not an integer."""
    if not text:
        return ()
    return tuple(int(part) for part in text.split(","))
