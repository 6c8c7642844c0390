"""A researcher's callbacks: hooks at a run's start, at each evaluation row, after each round (which may stop the run
early, e.g. at a target accuracy) and at its end, on every path (``fedray.run(..., callbacks=[...])``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fedray.core.errors import FedrayError, shown
from fedray.core.results import EvalPoint
from fedray.engine.round_loop import Callback as LoopCallback
from fedray.methods.base import Classifier


class Callback:
    """Subclass it and override what you need; each hook does nothing by default.

    ``after_round`` returning True stops the run at its next evaluation row (at
    once when the round was evaluated): the run ends there as a normal,
    complete run, its results written, its last row's ``stopped_early`` column
    true; no later training stage starts (SphereFed's calibration and the ridge
    probe still finish the classifier).
    """

    def on_start(self, config: dict[str, object]) -> None:
        """Before any work: the run's configuration, as config.yaml holds it."""

    def on_evaluation(self, row: dict[str, object], classifier: Classifier | None) -> None:
        """At each evaluation row: its columns and the classifier evaluated there (yours to keep)."""

    def after_round(self, round: int, stage: str) -> bool | None:
        """After round ``round`` (numbered as the rows are) of ``stage`` (``closed_form``, ``train``, ``tct_scaffold``),
        after its row when it was evaluated; True stops the run."""

    def on_end(self, rows: list[dict[str, object]]) -> None:
        """After the run wrote its results: its metrics rows."""


@dataclass
class Callbacks:
    """A run's researcher callbacks as the engine calls them, and whether one asked to stop."""

    callbacks: Sequence[Callback] = ()
    stopping: bool = False

    @staticmethod
    def checked(callbacks: object, where: str) -> "Callbacks":
        """``callbacks`` (a list of :class:`Callback` instances, or None) checked, in one line."""
        if callbacks is None:
            return Callbacks()
        if not isinstance(callbacks, (list, tuple)) or not all(isinstance(c, Callback) for c in callbacks):
            raise FedrayError(f"{where}: callbacks must be a list of fedray.Callback instances, got {shown(callbacks)}")
        return Callbacks(tuple(callbacks))

    def start(self, config: dict[str, object]) -> None:
        for callback in self.callbacks:
            callback.on_start(dict(config))

    def evaluation(self, point: EvalPoint, classifier: Classifier | None) -> None:
        for callback in self.callbacks:
            callback.on_evaluation(point.columns(), classifier)

    def after_round(self, round_number: int, stage: str) -> None:
        for callback in self.callbacks:
            if callback.after_round(round_number, stage):
                self.stopping = True

    def end(self, rows: list[dict[str, object]]) -> None:
        for callback in self.callbacks:
            callback.on_end([dict(row) for row in rows])

    def loop(self, stage: str, first_round: int = 0) -> "StageCallbacks":
        """The round loop's side of them for one stage, whose round r is the run's ``first_round`` + r."""
        return StageCallbacks(self, stage, first_round)


@dataclass
class StageCallbacks(LoopCallback):
    """:class:`Callbacks` in a stage's round loop (:func:`~fedray.engine.round_loop.run_rounds`)."""

    callbacks: Callbacks = field(default_factory=Callbacks)
    stage: str = "train"
    first_round: int = 0

    def after_round(self, number: int) -> None:
        self.callbacks.after_round(self.first_round + number, self.stage)

    def stop(self) -> bool:
        return self.callbacks.stopping
