"""A researcher's callbacks: hooks at a run's start, at each stage's start, at each evaluation row, after each round
(which may stop the run early, e.g. at a target accuracy) and at its end, on every path
(``fedray.run(..., callbacks=[...])``). The command line's progress bar is one (:class:`ProgressBar`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from fedray.core.errors import FedrayError, shown
from fedray.core.reports import column_value
from fedray.core.results import EvalPoint
from fedray.engine.config import COLUMNS
from fedray.engine.round_loop import Callback as LoopCallback, Listener
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

    def on_stage(self, stage: str, name: str, rounds: range, done: int) -> None:
        """Before a stage's rounds: the stage (``closed_form``, ``train``, ``tct_scaffold``), what it runs (``fed3r``,
        ``fedavg``, ...), its rounds (numbered as the rows are) and how many of them are done already (a resumed
        run's)."""

    def on_evaluation(self, row: dict[str, object], classifier: Classifier | None) -> dict[str, float | str] | None:
        """At each evaluation row: its columns and the classifier evaluated there (yours to keep). Return a dict to add
        columns to the row (a macro-F1, a per-class accuracy), in metrics.parquet and a sweep's results.parquet:
        names that are not the run's columns already, values numbers (NaN refused, ±inf kept, as
        :func:`fedray.report`'s) or one-line strings of at most 200 characters; a column keeps its kind (number or
        string) from row to row and is null on the rows that do not return it."""

    def after_round(self, round: int, stage: str) -> bool | None:
        """After round ``round`` (numbered as the rows are) of ``stage`` (``closed_form``, ``train``, ``tct_scaffold``),
        after its row when it was evaluated; True stops the run."""

    def on_stage_end(self, stage: str) -> None:
        """After a stage's rounds, however they ended (the last round, a stop, divergence, an error or an interrupt)."""

    def on_end(self, rows: list[dict[str, object]]) -> None:
        """After the run wrote its results: its metrics rows."""


def _kind(kind: type) -> str:
    return "string" if kind is str else "number"


@dataclass
class Callbacks:
    """A run's researcher callbacks as the engine calls them, and whether one asked to stop."""

    callbacks: Sequence[Callback] = ()
    stopping: bool = False
    taken: frozenset[str] = COLUMNS
    """The run's columns, which no callback column may be named (its configuration's are added when it starts)."""
    kinds: dict[str, type] = field(default_factory=dict)
    """Each callback column's kind so far (float or str): a column of one kind in every row."""

    @staticmethod
    def checked(callbacks: object, where: str) -> "Callbacks":
        """``callbacks`` (a list of :class:`Callback` instances, or None) checked, in one line."""
        if callbacks is None:
            return Callbacks()
        if not isinstance(callbacks, (list, tuple)) or not all(isinstance(c, Callback) for c in callbacks):
            raise FedrayError(f"{where}: callbacks must be a list of fedray.Callback instances, got {shown(callbacks)}")
        return Callbacks(tuple(callbacks))

    def start(self, config: dict[str, object]) -> None:
        self.taken = self.taken | set(config) | set(config.get("options") or {})
        for callback in self.callbacks:
            callback.on_start(dict(config))

    def stage(self, stage: str, name: str, rounds: range, done: int = 0) -> None:
        for callback in self.callbacks:
            callback.on_stage(stage, name, rounds, done)

    def evaluation(self, point: EvalPoint, classifier: Classifier | None) -> None:
        """Each callback's :meth:`Callback.on_evaluation` of ``point``, the columns it returns added to the point."""
        for callback in self.callbacks:
            returned = callback.on_evaluation(point.columns(), classifier)
            if returned is not None:
                point.callback_columns.update(self._checked(callback, returned, point))

    def _checked(self, callback: Callback, returned: object, point: EvalPoint) -> dict[str, float | str]:
        """``returned`` as columns of ``point``'s row, else one line naming ``callback``, the row and what is wrong."""
        where = f"{type(callback).__name__}.on_evaluation at round {point.round}"
        if not isinstance(returned, dict):
            raise FedrayError(f"{where} returned {shown(returned)}; expected None or a dict of columns "
                              f"{{name: number or string}}")
        columns: dict[str, float | str] = {}
        for name, value in returned.items():
            if not isinstance(name, str) or not name or name in self.taken or name in point.columns():
                raise FedrayError(f"{where} returned a column named {name!r}: "
                                  + ("a column of the run already; name it otherwise" if isinstance(name, str) and name
                                     else "expected a non-empty string"))
            column = column_value(value, f"{where} returned {name}:")
            kind = self.kinds.setdefault(name, type(column))
            if kind is not type(column):
                raise FedrayError(f"{where} returned {name}={shown(value)}, a {_kind(type(column))}, where earlier "
                                  f"rows had a {_kind(kind)}: a column holds one kind")
            columns[name] = column
        return columns

    def after_round(self, round_number: int, stage: str) -> None:
        for callback in self.callbacks:
            if callback.after_round(round_number, stage):
                self.stopping = True

    def stage_end(self, stage: str) -> None:
        for callback in self.callbacks:
            callback.on_stage_end(stage)

    def end(self, rows: list[dict[str, object]]) -> None:
        for callback in self.callbacks:
            callback.on_end([dict(row) for row in rows])

    @staticmethod
    def of_run(researcher: "Callbacks | None", quiet: bool) -> "Callbacks":
        """A run's callbacks: the progress bar (unless ``quiet``), then a researcher's."""
        mine = () if researcher is None else tuple(researcher.callbacks)
        return Callbacks(mine if quiet else (ProgressBar(), *mine))

    def hearing(self, listener: Listener | None) -> Listener | None:
        """A listener that passes each evaluation row to these callbacks, then, with the columns they added, to
        ``listener`` (when there is one)."""
        if not self.callbacks:
            return listener

        def both(point: EvalPoint, classifier: Classifier | None) -> None:
            self.evaluation(point, classifier)  # first: the columns they add reach the listener (a sweep's trial)
            if listener is not None:
                listener(point, classifier)
        return both

    def loop(self, stage: str, name: str, rounds: int, first_round: int = 0) -> "StageCallbacks":
        """The round loop's side of them for one stage of ``rounds`` rounds running ``name``, whose round r is the
        run's ``first_round`` + r; the loop calls their :meth:`Callback.on_stage` when it starts."""
        return StageCallbacks(self, stage, name, range(first_round + 1, first_round + rounds + 1))


@dataclass
class StageCallbacks(LoopCallback):
    """:class:`Callbacks` in a stage's round loop (:func:`~fedray.engine.round_loop.run_rounds`): ``on_stage`` when it
    starts, ``on_stage_end`` when it ends, however it ends."""

    callbacks: Callbacks
    stage: str
    name: str
    rounds: range
    """The stage's rounds, numbered as the rows are."""

    def start(self, done: int) -> None:
        self.callbacks.stage(self.stage, self.name, self.rounds, done)

    def after_round(self, number: int) -> None:
        self.callbacks.after_round(self.rounds.start - 1 + number, self.stage)

    def stop(self) -> bool:
        return self.callbacks.stopping

    def close(self) -> None:
        self.callbacks.stage_end(self.stage)


class Checkpoints(Callback):
    """``fedray run``'s checkpoints (``--checkpoint-every``): ``save()`` after every ``every``-th round of the training
    stage's ``rounds`` but its last (the run's results are written then). The engine makes one for each training stage
    with the saving, which needs what no other callback sees: the training state and the clients' states in the
    actors."""

    def __init__(self, every: int | None, rounds: range, save: Callable[[], None]) -> None:
        self.every, self.rounds, self.save = every, rounds, save

    def after_round(self, round: int, stage: str) -> None:
        number = round - self.rounds.start + 1
        if stage == "train" and self.every and number % self.every == 0 and number < len(self.rounds):
            self.save()


class ProgressBar(Callback):
    """A tqdm bar over each stage's rounds, showing the last evaluation's round, test accuracy and clients seen (said to
    be of that round: they stay as they were until the next evaluation); ``fedray run`` adds one unless ``--quiet``."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.first = 0
        """The run's number of the stage's first round."""

    def on_stage(self, stage: str, name: str, rounds: range, done: int) -> None:
        self._close()
        self.bar, self.first = tqdm(total=len(rounds), initial=done, unit="round", desc=name), rounds.start

    def on_evaluation(self, row: dict[str, object], classifier: Classifier | None) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"at round {row['round']}: test accuracy {row['accuracy']:.4f}, "
                                     f"{row['clients_seen']} clients seen", refresh=False)  # drawn with the round

    def after_round(self, round: int, stage: str) -> None:
        if self.bar is None:
            return
        done = round - self.first + 1
        if done < self.bar.total:
            self.bar.update(done - self.bar.n)
        else:  # the stage's last round: closing draws the full bar, once (a log, as ray job logs, keeps each drawing)
            self.bar.n = done

    def on_stage_end(self, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
