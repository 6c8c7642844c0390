"""The run's clock in the engine: built once from the configuration, handed each stage's tasks, and heard by the
rows.

What a client's task costs is what fedray already accounts for the stage: a
closed form's statistics (their FLOPs / 2 multiply-adds, plus the backbone's
F_φ per sample where known) and its upload, once, the first time its upload
arrives; a training round's local epochs (the backend's FLOPs / 2), the model
and broadcast it downloads and the sums it uploads; a stage after training
(SphereFed's calibration, ``--calibrate``, the ridge probe, TCT's stage 2) what
its accounting counts for each client's pass (:class:`ClientTasks`). Secure
aggregation's masks and key exchange are not on the clock yet: they take no
virtual time.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedray.clock.availability import AlwaysAvailable
from fedray.clock.choices import ClockChoices, selector_class
from fedray.clock.costs import Amount, TaskCost
from fedray.clock.devices import Devices
from fedray.clock.rounds import SynchronousRounds
from fedray.clock.run_clock import ClockedRound, RunClock
from fedray.core.federation import Federation
from fedray.core.options import build
from fedray.core.results import EvalPoint
from fedray.engine.config import RunConfig
from fedray.engine.parts import Sampler
from fedray.engine.round_loop import Callback
from fedray.methods.algorithm import FederatedAlgorithm
from fedray.methods.base import FLOAT_BYTES, ClosedFormMethod
from fedray.methods.postprocessor import Sampling, StageUploads
from fedray.methods.training.backend import Params, TrainingBackend


def run_clock(config: RunConfig, federation: Federation, sampler: Sampler) -> RunClock | None:
    """The clock of ``config`` (validated) on ``federation``, its options checked (a device table of client ids
    against the population, availability that can fill a round); None for a run that gives none of its options."""
    if not config.clocked:
        return None
    choices = config.component(ClockChoices)
    devices = config.component(Devices)
    if devices.table.client_id is not None:
        devices.assign(federation.num_clients, config.seed)
    spec = choices.selector_spec(sampler.poisson)
    cls = selector_class(spec)
    selector = build(cls, config.option_values(cls), f"--selector {spec}", seed=config.seed)
    availability = choices.availability_model(config.seed)
    if isinstance(availability, AlwaysAvailable):  # no lookup needed
        availability = None
    clock = RunClock(devices, availability, config.component(SynchronousRounds), selector, spec,
                     federation.num_clients, sampler.per_round, config.seed, sampler.poisson, choices.every_s)
    if availability is not None:
        availability.check_rounds_can_fill(sampler.per_round, federation.num_clients)
    return clock


@dataclass
class ClockColumns(Callback):
    """Adds the clock's columns to each row, before the rows' listeners hear it (first among the callbacks)."""

    clock: RunClock

    def on_point(self, point: EvalPoint) -> None:
        point.clock_columns.update(self.clock.columns(point.round))


@dataclass(frozen=True)
class ClosedFormTasks:
    """A closed-form client's task: its statistics' multiply-adds and its upload's bytes (it downloads nothing)."""

    macs: np.ndarray
    up_bytes: np.ndarray

    @classmethod
    def of(cls, method: ClosedFormMethod, federation: Federation, backbone_macs: float | None) -> ClosedFormTasks:
        sizes = federation.client_sizes.astype(np.float64)
        macs = np.nan_to_num(method.statistics_flops(sizes), nan=0.0) / 2  # not counted (NaN): no time
        if backbone_macs is not None:
            macs = macs + backbone_macs * sizes
        return cls(macs, method.upload_floats(federation).astype(np.float64) * FLOAT_BYTES)

    def cost(self) -> TaskCost:
        """Every client's task, for the deadline's check."""
        return TaskCost(self.macs, 0.0, self.up_bytes)


def clocked_closed_form(clock: RunClock, schedule: Sequence[np.ndarray], tasks: ClosedFormTasks,
                        stage: str) -> list[ClockedRound]:
    """A closed form's rounds on the clock: a client computes and uploads its statistics until its upload arrives
    once, and costs nothing when asked again (it has nothing more to send)."""
    arrived = np.zeros(len(tasks.macs), dtype=bool)

    def costs(clients: np.ndarray) -> TaskCost:
        due = ~arrived[clients]
        return TaskCost(np.where(due, tasks.macs[clients], 0.0), 0.0, np.where(due, tasks.up_bytes[clients], 0.0))

    records = []
    for number, scheduled in enumerate(schedule, start=1):
        record = clock.round(number, stage, scheduled, costs)
        arrived[record.clients] = True
        records.append(record)
    return records


@dataclass(frozen=True)
class TrainingTasks:
    """A training client's task: its local epochs' multiply-adds, the model and broadcast it downloads, the sums it
    uploads, and its local steps."""

    macs: np.ndarray
    down_bytes: float
    up_bytes: float
    steps: np.ndarray

    @classmethod
    def of(cls, backend: TrainingBackend, algorithm: FederatedAlgorithm, model: Params, algorithm_state: Params,
           sizes: np.ndarray) -> TrainingTasks:
        """``model``: the parameters the clients train; the upload's size is that of the sums of an empty round (its
        shapes found on PyTorch's meta device)."""
        from fedray.engine.training import empty_sums  # the training loop imports this module

        broadcast = algorithm.broadcast(model, algorithm_state)
        down = backend.model_floats() + sum(tensor.numel() for tensor in broadcast.values())
        up = sum(tensor.numel() for tensor in empty_sums(algorithm, model, broadcast).values())
        return cls(backend.client_flops(sizes.astype(np.float64)) / 2, float(down * FLOAT_BYTES),
                   float(up * FLOAT_BYTES), backend.local_steps(np.arange(len(sizes))))

    def costs(self, clients: np.ndarray) -> TaskCost:
        return TaskCost(self.macs[clients], self.down_bytes, self.up_bytes)


def clocked_training(clock: RunClock, schedule: Sequence[np.ndarray], tasks: TrainingTasks,
                     first_round: int, stage: str) -> list[ClockedRound]:
    """Training's rounds on the clock, numbered after ``first_round`` rounds of the run."""
    return [clock.round(first_round + number, stage, scheduled, tasks.costs, lambda clients: tasks.steps[clients])
            for number, scheduled in enumerate(schedule, start=1)]


@dataclass(frozen=True)
class ClientTasks:
    """Each client's task in a round of a stage after training (a calibration, the ridge probe, TCT's stage 2): the
    multiply-adds of its pass and the bytes it downloads and uploads, each one amount for every client or one per
    client of the federation."""

    macs: Amount
    down_bytes: Amount = 0.0
    up_bytes: Amount = 0.0

    @classmethod
    def closed_form(cls, method: ClosedFormMethod, federation: Federation) -> ClientTasks:
        """A closed form's statistics after training (what a calibration's accounting counts: their FLOPs / 2 and
        its upload; nothing downloaded)."""
        tasks = ClosedFormTasks.of(method, federation, None)
        return cls(tasks.macs, 0.0, tasks.up_bytes)

    def costs(self, clients: np.ndarray) -> TaskCost:
        return TaskCost(*(amount if np.ndim(amount) == 0 else np.asarray(amount)[clients]
                          for amount in (self.macs, self.down_bytes, self.up_bytes)))


def clocked_everyone(clock: RunClock, number: int, stage: str, tasks: ClientTasks) -> ClockedRound:
    """Round ``number`` of ``stage`` asking every client once (a calibration, the ridge probe, TCT's normalization
    and closed form) on the clock, which it advances: the selector, availability and deadline of any round, with the
    federation as the schedule's row."""
    return clock.round(number, stage, np.arange(clock.num_clients, dtype=np.int64), tasks.costs)


@dataclass
class FirstPassClock:
    """A stage's rounds on the run's clock whose clients make one pass over their samples before their first upload of
    the stage (TCT's eNTK features at the stage-1 weights, ``first_macs`` per client), besides each round's task: a
    client pays the pass in the first round that keeps its upload, and is charged it again until one does."""

    clock: RunClock
    first_macs: np.ndarray
    passed: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.passed = np.zeros(len(self.first_macs), dtype=bool)

    def round(self, number: int, stage: str, scheduled: np.ndarray, tasks: ClientTasks) -> ClockedRound:
        """Round ``number`` of ``stage`` from the schedule's row ``scheduled``, which advances the clock."""
        def costs(clients: np.ndarray) -> TaskCost:
            return tasks.costs(clients) + TaskCost(np.where(self.passed[clients], 0.0, self.first_macs[clients]))

        record = self.clock.round(number, stage, scheduled, costs)
        self.passed[record.clients] = True
        return record


def clocked_closed_form_uploads(stage: str, sampling: Sampling, records: Sequence[ClockedRound],
                                evaluate_at: Container[int], summed: bool = True) -> StageUploads:
    """A closed form's uploads on the clock (its rounds ``records``, numbered from 1): each client's first kept upload,
    summed an evaluation block at a time, the blocks ending at the rounds of ``evaluate_at`` (as
    :class:`~fedray.engine.closed_form.ClosedFormRounds` forms them); ``group`` and ``smallest_group`` are the most and
    fewest uploads of a block with any. ``summed``: the method's :attr:`~fedray.ClosedFormMethod.uploads_summed`."""
    seen = np.zeros(sampling.population, dtype=bool)
    blocks, uploads = [], 0
    for number, record in enumerate(records, start=1):
        new = record.clients[~seen[record.clients]]  # a round's clients are distinct
        seen[new] = True
        uploads += len(new)
        if number in evaluate_at:
            blocks.append(uploads)
            uploads = 0
    sizes = [size for size in blocks if size] or [0]
    return StageUploads(stage, False, sampling, len(records), max(sizes), min(sizes), summed)
