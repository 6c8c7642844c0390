"""The run's clock in the engine: built once from the configuration, handed each stage's tasks, and heard by the
rows.

What a client's task costs is what fedray already accounts for the stage: a
closed form's statistics (their FLOPs / 2 multiply-adds, plus the backbone's
F_φ per sample where known) and its upload, once, the first time its upload
arrives; a training round's local epochs (the backend's FLOPs / 2), the model
and broadcast it downloads and the sums it uploads. A postprocessor's protocol
(secure aggregation's key agreement, masks and masked vector:
:meth:`~fedray.Postprocessor.protocol_cost`) adds to the task of each client
whose upload goes into an aggregate, as a participant that completes it, in a
group of the size the aggregate is planned to have when the round starts: a
training round's κ clients; a closed form's evaluation block's clients not yet
heard from in its scheduled rounds (with ``--eval-every-s``, whose blocks the
clock's own times decide, the round's). SphereFed's calibration, the ridge
probe and TCT's stage 2 are not on the clock yet: they take no virtual time.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from fedray.clock.asynchronous import AsynchronousRounds
from fedray.clock.availability import AlwaysAvailable
from fedray.clock.choices import ClockChoices, selector_class
from fedray.clock.costs import TaskCost
from fedray.clock.devices import Devices
from fedray.clock.hearing import StillToHear
from fedray.clock.rounds import SynchronousRounds
from fedray.clock.run_clock import ClockedRound, RunClock
from fedray.core.errors import FedrayError
from fedray.core.federation import Federation
from fedray.core.options import build, options_of
from fedray.core.results import EvalPoint
from fedray.engine.asynchronous import check_asynchronous
from fedray.engine.config import RunConfig
from fedray.engine.parts import Sampler
from fedray.engine.round_loop import Callback
from fedray.methods.algorithm import FederatedAlgorithm, keeps_client_state
from fedray.methods.base import FLOAT_BYTES, ClosedFormMethod
from fedray.methods.postprocessor import Postprocessing
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
    synchronous, asynchronous = config.component(SynchronousRounds), config.component(AsynchronousRounds)
    if asynchronous.asynchronous:
        _check_asynchronous(config, asynchronous, synchronous, spec)
    clock = RunClock(devices, availability, synchronous, selector, spec, federation.num_clients, sampler.per_round,
                     config.seed, sampler.poisson, choices.every_s, asynchronous)
    if availability is not None:
        availability.check_rounds_can_fill(sampler.per_round, federation.num_clients)
    return clock


def _check_asynchronous(config: RunConfig, scheduler: AsynchronousRounds, synchronous: SynchronousRounds,
                        selector: str) -> None:
    """Refuse in one line, before any work, an asynchronous scheduler where it does not apply."""
    if not config.trains:
        raise FedrayError(f"{scheduler.flag} schedules training's server steps: {config.method} "
                          f"does not train")
    given = [f"--{name.replace('_', '-')}" for name in options_of(SynchronousRounds)
             if getattr(synchronous, name) is not None]
    check_asynchronous(scheduler, keeps_client_state(config.algorithm_class()), config.method, bool(config.postprocessor_specs()),
                       given, selector)


@dataclass
class ClockColumns(Callback):
    """Adds the clock's columns to each row, before the rows' listeners hear it (first among the callbacks); an
    asynchronous run's staleness columns are over the server steps since the row before."""

    clock: RunClock
    previous: int | None = None
    """The round of the row before (None: none yet)."""

    def on_point(self, point: EvalPoint) -> None:
        point.clock_columns.update(self.clock.columns(point.round, self.previous))
        self.previous = point.round


@dataclass(frozen=True)
class ClosedFormTasks:
    """A closed-form client's task: its statistics' multiply-adds and its upload's bytes (it downloads nothing), and
    the values of the statistics' aggregate (what a secure sum masks, every client's the same length)."""

    macs: np.ndarray
    up_bytes: np.ndarray
    values: int

    @classmethod
    def of(cls, method: ClosedFormMethod, federation: Federation, backbone_macs: float | None) -> ClosedFormTasks:
        sizes = federation.client_sizes.astype(np.float64)
        macs = np.nan_to_num(method.statistics_flops(sizes), nan=0.0) / 2  # not counted (NaN): no time
        if backbone_macs is not None:
            macs = macs + backbone_macs * sizes
        return cls(macs, method.upload_floats(federation).astype(np.float64) * FLOAT_BYTES,
                   method.statistics_floats())

    def cost(self) -> TaskCost:
        """Every client's task, for the deadline's check."""
        return TaskCost(self.macs, 0.0, self.up_bytes)


def clocked_closed_form(clock: RunClock, schedule: Sequence[np.ndarray], tasks: ClosedFormTasks, stage: str,
                        postprocessing: Postprocessing = Postprocessing(),
                        blocks: Container[int] | None = None) -> list[ClockedRound]:
    """A closed form's rounds on the clock: its schedule's, then as many more as it takes to hear every client of
    the schedule (:class:`~fedray.clock.hearing.StillToHear`: a round draws only clients not heard yet, one whose
    upload is lost is asked again). A client computes and uploads its statistics until its upload arrives once, and
    costs nothing when the schedule asks it again (it has nothing more to send). ``blocks``: the rounds that end an
    evaluation block (None: each round ends one), whose uploads the postprocessors' protocol sums together; the
    rounds after the schedule's are timed with the last block's protocol."""
    hearing = clock.still_to_hear(schedule, len(tasks.macs))
    protocol: TaskCost | None = None

    def costs(clients: np.ndarray) -> TaskCost:
        due = ~hearing.heard[clients]
        macs, up = np.where(due, tasks.macs[clients], 0.0), np.where(due, tasks.up_bytes[clients], 0.0)
        if protocol is None:
            return TaskCost(macs, 0.0, up)
        return TaskCost(macs + np.where(due, protocol.macs, 0.0), np.where(due, protocol.down_bytes, 0.0),
                        np.where(due, protocol.up_bytes, 0.0))

    records = []
    block_start = True
    for number, scheduled in enumerate(schedule, start=1):
        if block_start and postprocessing.postprocessors:
            end = number
            while blocks is not None and end < len(schedule) and end not in blocks:
                end += 1
            planned = np.unique(np.concatenate([schedule[index] for index in range(number - 1, end)]))
            protocol = postprocessing.protocol_cost(int((~hearing.heard[planned]).sum()), tasks.values)
        record = clock.round(number, stage, hearing.row(scheduled), costs, places=len(scheduled), hearing=hearing)
        hearing.hear(record.clients, record.lost)
        records.append(record)
        block_start = blocks is None or number in blocks
    number = len(schedule)
    while hearing.remaining:
        number += 1
        record = clock.round(number, stage, np.zeros(0, dtype=np.int64), costs, places=clock.per_round,
                             hearing=hearing)
        if not hearing.eligible[record.selected].any():
            raise FedrayError(f"selector {clock.selector_name} asked none of the clients the {stage} stage still has "
                              f"to hear ({hearing.remaining}) in round {number}: it would never end")
        hearing.hear(record.clients, record.lost)
        records.append(record)
    return records


@dataclass(frozen=True)
class TrainingTasks:
    """A training client's task: its local epochs' multiply-adds, the model and broadcast it downloads, the sums it
    uploads (``values`` of them), and its local steps."""

    macs: np.ndarray
    down_bytes: float
    values: int
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
        return cls(backend.client_flops(sizes.astype(np.float64)) / 2, float(down * FLOAT_BYTES), int(up),
                   backend.local_steps(np.arange(len(sizes))))

    @property
    def up_bytes(self) -> float:
        return float(self.values * FLOAT_BYTES)

    def costs(self, clients: np.ndarray, protocol: TaskCost | None = None) -> TaskCost:
        """The task of ``clients``, with ``protocol`` (the postprocessors', :meth:`Postprocessing.protocol_cost`)."""
        if protocol is None:
            return TaskCost(self.macs[clients], self.down_bytes, self.up_bytes)
        return TaskCost(self.macs[clients] + protocol.macs, self.down_bytes + protocol.down_bytes, protocol.up_bytes)


def clocked_training(clock: RunClock, schedule: Sequence[np.ndarray], tasks: TrainingTasks, first_round: int,
                     stage: str, postprocessing: Postprocessing = Postprocessing()) -> list[ClockedRound]:
    """Training's rounds on the clock, numbered after ``first_round`` rounds of the run; each round's uploads summed
    into one aggregate of its scheduled clients, by ``postprocessing``'s protocol."""
    records = []
    for number, scheduled in enumerate(schedule, start=1):
        protocol = postprocessing.protocol_cost(len(scheduled), tasks.values)
        records.append(clock.round(first_round + number, stage, scheduled, partial(tasks.costs, protocol=protocol),
                                   lambda clients: tasks.steps[clients]))
    return records
