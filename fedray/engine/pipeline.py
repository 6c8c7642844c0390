"""A run as a pipeline: the plan's stages, each an object that knows what it runs, uploads and needs in memory, run in
order by :func:`run_stages`, each handed what the one before it left (:class:`StageResult`).

A stage (:class:`Stage`) runs in a :class:`StageContext`: the plan's shared
parts (sampling, the run's one postprocessing, the shards' resources), the
federation, the shard pool on its features (started when a stage first asks
for it), the run's callbacks and listener, and the checkpoint a resumed run
continues from. What passes from one stage to the next is the result: the
rows so far (and so the run's round count), the accounting, the model's
parameters, the clients of each round, what the run writes, and the trained
model's backend and features for the stages after training. The runner looks
at none of it: adding a kind of stage is one class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from ray.util.placement_group import PlacementGroup

from fedray.clock.run_clock import RunClock
from fedray.core.federation import Federation
from fedray.core.results import EvalPoint
from fedray.engine.callbacks import Callbacks
from fedray.engine.checkpoint import RunShape
from fedray.engine.parts import Sampler, Shards
from fedray.engine.round_loop import Listener
from fedray.engine.training import Accounting, TrainingState
from fedray.methods.postprocessor import Postprocessing, StageUploads
from fedray.methods.training.backend import Params, TrainingBackend
from fedray.runtime.evaluator import Evaluator
from fedray.runtime.footprint import Footprint
from fedray.runtime.schedules import Schedule
from fedray.runtime.shards import ShardPool

T = TypeVar("T")

Embeddings = Callable[[Params, Callable[[ShardPool, Evaluator], T]], T]
"""Where the closed-form stages after training run: ``embeddings(params, work)`` runs ``work(pool, evaluator)`` on
shards holding the features at ``params``: the pool's own features (linear probing, SphereFed), or the images embedded
by the backbone of ``params`` (fine-tuning)."""


@dataclass
class StageResult:
    """What a stage leaves the next one, and at the end what the run writes."""

    points: list[EvalPoint] = field(default_factory=list)
    """The run's rows so far."""
    accounting: Accounting | None = None
    """Cumulative traffic, compute and coverage behind the rows (None before any stage counted)."""
    params: Params = field(default_factory=dict)
    """The model's parameters: the trained head, projection or network (none for a closed form alone)."""
    rounds: Schedule = field(default_factory=Schedule.of)
    """The clients of each round, numbered as the rows are: round r's are ``rounds[r - 1]``."""
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    """classifier.npz's arrays."""
    model: Params | None = None
    """model.pt's state dict (a network fine-tuned on images), if any."""
    last_columns: dict[str, Any] = field(default_factory=dict)
    """Columns of the last row only (``ridge_probe_accuracy``)."""
    resolved: dict[str, Any] = field(default_factory=dict)
    """Configuration values found while running (the shard count, Fed3R-RF's σ), for config.yaml and the rows."""
    backend: TrainingBackend | None = None
    """The trained model's backend, for the stages after training (its calibration map, TCT's eNTK)."""
    embeddings: Embeddings | None = None
    """Where the closed-form stages after training find the features at the trained parameters."""

    @property
    def round(self) -> int:
        """The run's rounds so far: the last row's (0 before any)."""
        return self.points[-1].round if self.points else 0


class Stage:
    """One stage of a run. Subclasses implement :meth:`run`; what they upload, need in memory, check before any
    work and resume from a checkpoint are none by default."""

    def run(self, context: StageContext, previous: StageResult) -> StageResult:
        """Run this stage after ``previous`` (an empty result for the first stage); what it leaves the next."""
        raise NotImplementedError

    def uploads(self, run: RunPlan) -> tuple[StageUploads, ...]:
        """What it will send through the postprocessors, in order, for their :meth:`~fedray.Postprocessor.start`."""
        return ()

    def footprints(self, run: RunPlan, federation: Federation) -> tuple[Footprint, ...] | None:
        """The memory it needs on ``federation``'s features (None: not estimated, and so the run is not: on
        images)."""
        return ()

    def check(self, run: RunPlan, federation: Federation) -> None:
        """Refuse what it cannot run on ``federation``, in one line, before any work."""

    def checkpoint_shape(self, run: RunPlan, federation: Federation) -> RunShape | None:
        """What a checkpoint this stage resumes from must fit (None: it writes none)."""
        return None


@dataclass(frozen=True)
class RunPlan:
    """A run's built parts and its stages, in order."""

    out: Path
    identity: dict
    """The configuration as config.yaml holds it: what a checkpoint must match to resume."""
    seed: int
    eval_every: int
    quiet: bool
    backbone_macs: float | None
    sampler: Sampler
    postprocessing: Postprocessing
    shards: Shards
    stages: tuple[Stage, ...]
    footprints: list[Footprint] = field(default_factory=list)
    clock: RunClock | None = field(default=None, compare=False)
    """The run's clock, its time carried from stage to stage (None: the run has none)."""
    drawn: dict[tuple[int | None, bool], Schedule] = field(default_factory=dict, compare=False, repr=False)
    """The schedules :meth:`rounds` drew, each drawn once."""

    def rounds(self, count: int | None, past_coverage: bool = False) -> Schedule:
        """The run's sampler's ``count`` rounds (see :meth:`Sampler.rounds`), drawn once for every stage that asks
        (the checkpoint's check, the memory estimate, the run)."""
        key = (count, past_coverage)
        if key not in self.drawn:
            self.drawn[key] = self.sampler.rounds(count, past_coverage)
        return self.drawn[key]

    def stage_uploads(self) -> tuple[StageUploads, ...]:
        """What each stage will upload, for the postprocessors' :meth:`~fedray.Postprocessor.start`."""
        return tuple(uploads for stage in self.stages for uploads in stage.uploads(self))

    def checkpoint_shape(self, federation: Federation) -> RunShape | None:
        """What a checkpoint of this run must fit: its stages' (None: none of them writes one)."""
        return next((shape for stage in self.stages if (shape := stage.checkpoint_shape(self, federation)) is not None),
                    None)


def footprints(run: RunPlan, federation: Federation) -> list[Footprint]:
    """The memory each stage of ``run`` needs on ``federation``'s features; none where a stage is not estimated (on
    images), and the stages after it are not asked."""
    estimated: list[Footprint] = []
    for stage in run.stages:
        told = stage.footprints(run, federation)
        if told is None:  # the stages after it run on what it leaves (a network's embeddings): none is either
            return []
        estimated.extend(told)
    return estimated


class StageContext:
    """What every stage of a run runs with (see the module's docstring); :meth:`close` shuts down what it started."""

    def __init__(self, run: RunPlan, federation: Federation, callbacks: Callbacks, on_point: Listener | None = None,
                 saved: TrainingState | None = None, trial_group: PlacementGroup | None = None) -> None:
        self.run, self.federation, self.callbacks, self.on_point = run, federation, callbacks, on_point
        self.saved, self.trial_group = saved, trial_group
        """``saved``: the checkpoint a resumed run continues from."""
        self._pool: ShardPool | None = None
        self._evaluator: Evaluator | None = None
        self._held: dict[int, Callable[[], None]] = {}

    @property
    def postprocessing(self) -> Postprocessing:
        """The run's one postprocessing: every stage's uploads pass through it (its state carries between them)."""
        return self.run.postprocessing

    @property
    def pool(self) -> ShardPool:
        """The shards holding the federation's features, started the first time a stage asks (the run's resources
        and memory estimate, a Tune trial's bundles), or those an earlier run parked; shut down (or parked) by
        :meth:`close`."""
        if self._pool is None:
            shards = self.run.shards
            self._pool = ShardPool.start(self.federation, shards.count, shards.cpus, trial_group=self.trial_group,
                                         state_budget=shards.state_memory, footprints=self.run.footprints,
                                         reusable=True)
        return self._pool

    @property
    def evaluator(self) -> Evaluator:
        """The test-set evaluator on :attr:`pool`."""
        if self._evaluator is None:
            self._evaluator = Evaluator(self.pool)
        return self._evaluator

    def hold(self, resource: object, shutdown: Callable[[], None]) -> None:
        """Shut ``resource`` down with ``shutdown`` when the run ends, unless :meth:`release`\\ d before."""
        self._held[id(resource)] = shutdown

    def release(self, resource: object) -> None:
        """Shut ``resource`` down now (a stage that needs its machines for what follows)."""
        shutdown = self._held.pop(id(resource), None)
        if shutdown is not None:
            shutdown()

    def close(self) -> None:
        """Shut down what the run's stages started, the last first, and the shard pool."""
        try:
            while self._held:
                self._held.pop(next(reversed(self._held)))()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None


def run_stages(stages: tuple[Stage, ...], context: StageContext) -> StageResult:
    """Run ``stages`` in order in ``context``, each after what the one before it left."""
    result = StageResult()
    for stage in stages:
        result = stage.run(context, result)
    return result
