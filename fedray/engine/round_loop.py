"""The one round loop every path runs, with evaluation, divergence, checkpoints and reporting as callbacks.

A path says what one round does (:meth:`Rounds.run_round`) and what its
evaluation row is (:meth:`Rounds.point`); :func:`run_rounds` and the callbacks
do the rest in the same way for closed-form methods, training on features or
on images, and TCT's stage 2. A callback is a small object with two hooks, so a
new one (a logger, an early stop, a privacy accountant) is added in one place
for every path.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
from fedray.core import interrupts
from fedray.core.results import EvalPoint
from fedray.methods.base import Classifier

Listener = Callable[[EvalPoint, "Classifier | None"], None]
"""Hears every evaluation row with the classifier evaluated there: a closed form's solve, a training run's head
(None where a row has none)."""


class Rounds(Protocol):
    """What one path does in a round and how it reports."""

    def run_round(self, number: int, clients: np.ndarray) -> bool:
        """Round ``number`` (from 1) on ``clients``; False when it diverged (the path keeps its last finite state)."""

    def point(self, number: int, diverged: bool = False) -> EvalPoint:
        """The evaluation row after round ``number`` (0: the initial model); accuracy NaN when ``diverged``."""

    def classifier(self) -> Classifier | None:
        """The classifier the last row evaluated, the caller's to keep (asked only when a :class:`Report` has a listener)."""


class Callback:
    """Hooks of :func:`run_rounds`; each does nothing unless overridden."""

    def start(self, done: int) -> None:
        """Called first, with the rounds done already; :meth:`close` follows however the loop ends (a progress bar
        opened here is closed before an interrupt's last line is printed)."""

    def on_point(self, point: EvalPoint) -> None:
        """Called with every evaluation row, the diverged one included, in order."""

    def after_round(self, number: int) -> None:
        """Called after round ``number`` finished (and was evaluated when it was due); not after a diverged round."""

    def close(self) -> None:
        """Called when the loop ends, however it ends (an error or an interrupt included)."""

    def stop(self) -> bool:
        """Asked after each evaluated round: True ends the loop there (a researcher's early stop)."""
        return False


@dataclass(frozen=True)
class EvalRounds:
    """The rounds evaluated, as a rule rather than a set of numbers (a run of any length holds none): every
    ``every``-th, the ``last``, and round 0 (the initial model) when ``initial``."""

    last: int
    every: int
    initial: bool = False

    def __contains__(self, number: int) -> bool:
        if number == self.last or number == 0 and self.initial:
            return True
        return 0 < number <= self.last and number % self.every == 0


def run_rounds(path: Rounds, rounds: Sequence[np.ndarray], evaluate_at: Container[int], callbacks: list[Callback],
               done: int = 0) -> bool:
    """Run ``rounds[done:]`` of ``path``; whether it diverged (the run stops at that round, its row says so). A
    callback's :meth:`Callback.stop` ends it at an evaluated round."""

    def emit(point: EvalPoint) -> None:
        for callback in callbacks:
            callback.on_point(point)

    try:
        for callback in callbacks:
            callback.start(done)
        if done == 0 and 0 in evaluate_at:
            emit(path.point(0))
        for number in range(done + 1, len(rounds) + 1):
            interrupts.check()
            if not path.run_round(number, rounds[number - 1]):
                emit(path.point(number, diverged=True))
                return True
            if number in evaluate_at:
                emit(path.point(number))
            for callback in callbacks:
                callback.after_round(number)
            if number in evaluate_at and any(callback.stop() for callback in callbacks):
                return False
        return False
    finally:
        for callback in callbacks:
            callback.close()


@dataclass
class Report(Callback):
    """Keeps every row in ``points`` and passes it to ``listener`` (a Tune trial's report, ``fedray.run``'s
    ``on_evaluation``) with the path's ``classifier()`` at that row."""

    points: list[EvalPoint]
    listener: Listener | None = None
    classifier: Callable[[], Classifier | None] = field(default=lambda: None, repr=False)

    def on_point(self, point: EvalPoint) -> None:
        self.points.append(point)
        if self.listener is not None:
            self.listener(point, self.classifier())

