"""The run's clock in the engine: built once from the configuration, handed each stage's tasks, and heard by the
rows.

What a client's task costs is what fedray already accounts for the stage: a
closed form's statistics (their FLOPs / 2 multiply-adds, plus the backbone's
F_φ per sample where known) and its upload, once, the first time its upload
arrives; a training round's local epochs (the backend's FLOPs / 2), the model
and broadcast it downloads and the sums it uploads; a stage after training
(SphereFed's calibration, ``--calibrate``, the ridge probe, TCT's stage 2) what
its accounting counts for each client's pass (:class:`ClientTasks`). A
postprocessor's protocol (secure aggregation's key agreement, masks and masked
vector: :meth:`~fedray.Postprocessor.protocol_cost`) adds to the task of each
client whose upload goes into an aggregate, as a participant that completes it,
in a group of the size the aggregate is planned to have when the round starts:
a training round's κ clients (TCT's SCAFFOLD rounds too); a closed form's
evaluation block's clients not yet heard from in its scheduled rounds (with
``--eval-every-s``, whose blocks the clock's own times decide, the round's); a
stage that asks every client once (a calibration, the ridge probe, TCT's
normalization and closed form), every client. The stages that must hear every
client (a closed form, and those that ask every client once) go through one
hearing loop (:func:`clocked_closed_form`): rounds that draw only clients not
heard yet, numbered on after the stage's own, until every client is heard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TypeVar, overload

import numpy as np

from fedray.clock.asynchronous import AsynchronousRounds
from fedray.clock.availability import AlwaysAvailable
from fedray.clock.choices import ClockChoices, selector_class
from fedray.clock.costs import Amount, TaskCost
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
from fedray.methods.postprocessor import Postprocessing, Sampling, StageUploads
from fedray.methods.training.backend import ClientLosses, Params, TrainingBackend
from fedray.runtime.schedules import Schedule

T = TypeVar("T")


def run_clock(config: RunConfig, federation: Federation, sampler: Sampler) -> RunClock | None:
    """The clock of ``config`` (validated) on ``federation``, its options checked (a device table of client ids
    against the population, availability that can fill a round); None for a run that gives none of its options."""
    if not config.clocked:
        return None
    choices = config.component(ClockChoices)
    devices = config.component(Devices)
    devices.assign(federation.num_clients, config.seed)  # checks a table of client ids; keeps every client's device
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
    down_bytes: float = 0.0

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


@dataclass(frozen=True)
class ClockedPass:
    """What a closed form's stage keeps of its rounds on the clock, planned once before any work: when the first
    starts, the clients each keeps (:meth:`~fedray.runtime.schedules.Schedule.packed`) and when each ends. Not the
    rounds themselves: an object and an array a round, about twice the memory (10 MB at a million clients), held to
    the run's end."""

    start_s: float
    rounds: Schedule
    ends: np.ndarray

    @classmethod
    def of(cls, start_s: float, records: Sequence[ClockedRound]) -> ClockedPass:
        return cls(start_s, Schedule.packed([record.clients for record in records]),
                   np.array([record.end_s for record in records], dtype=np.float64))


def clocked_closed_form(clock: RunClock, schedule: Sequence[np.ndarray], tasks: ClosedFormTasks | ClientTasks,
                        stage: str, postprocessing: Postprocessing = Postprocessing(),
                        blocks: Container[int] | None = None, first_round: int = 0) -> list[ClockedRound]:
    """A closed form's rounds on the clock (the hearing loop of every stage that must hear its clients): its
    schedule's, numbered after the run's ``first_round`` rounds, then as many more as it takes to hear every client of
    the schedule (:class:`~fedray.clock.hearing.StillToHear`: a round draws only clients not heard yet, one whose
    upload is lost is asked again). A client computes and uploads its statistics until its upload arrives once, and
    costs nothing when the schedule asks it again (it has nothing more to send). ``blocks``: the rounds (numbered from
    1) that end an evaluation block (None: each round ends one), whose uploads the postprocessors' protocol sums
    together; the rounds after the schedule's are timed with the last block's protocol."""
    with clock.population_kept():  # its lookups ask about every client still to hear, round after round
        return _hearing_loop(clock, schedule, tasks, stage, postprocessing, blocks, first_round)


def _hearing_loop(clock: RunClock, schedule: Sequence[np.ndarray], tasks: ClosedFormTasks | ClientTasks, stage: str,
                  postprocessing: Postprocessing, blocks: Container[int] | None,
                  first_round: int) -> list[ClockedRound]:
    """:func:`clocked_closed_form`'s rounds."""
    hearing = clock.still_to_hear(schedule, clock.num_clients)
    protocol: TaskCost | None = None

    def costs(clients: np.ndarray) -> TaskCost:
        due = ~hearing.heard[clients]
        macs, down, up = (_owed(due, amount, clients) for amount in (tasks.macs, tasks.down_bytes, tasks.up_bytes))
        if protocol is None:
            return TaskCost(macs, down, up)
        return TaskCost(macs + np.where(due, protocol.macs, 0.0), down + np.where(due, protocol.down_bytes, 0.0),
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
        record = clock.round(first_round + number, stage, hearing.row(scheduled), costs, places=len(scheduled),
                             hearing=hearing)
        hearing.hear(record.clients, record.lost)
        records.append(record)
        block_start = blocks is None or number in blocks
    number = len(schedule)
    while hearing.remaining:
        number += 1
        record = clock.round(first_round + number, stage, np.zeros(0, dtype=np.int64), costs,
                             places=clock.per_round, hearing=hearing)
        if not hearing.eligible[record.selected].any():
            raise FedrayError(f"selector {clock.selector_name} asked none of the clients the {stage} stage still has "
                              f"to hear ({hearing.remaining}) in round {first_round + number}: it would never end")
        hearing.hear(record.clients, record.lost)
        records.append(record)
    return records


def _owed(due: np.ndarray, amount: Amount, clients: np.ndarray) -> np.ndarray:
    """Each of ``clients``' ``amount`` where it is ``due``, else 0."""
    return np.where(due, _of_clients(amount, clients), 0.0)


def _of_clients(amount: Amount, clients: np.ndarray) -> Amount:
    """``clients``' ``amount``: one for all as it is, or one per client of the federation at theirs."""
    return amount if np.ndim(amount) == 0 else np.asarray(amount)[clients]


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


class ClockedTraining(Sequence[np.ndarray]):
    """Training's synchronous rounds on the clock, each clocked when the round loop first asks for its clients.

    Round r is clocked (the selector picks its clients, their durations decide
    who finishes and when it ends) only once round r − 1 has trained and the
    losses its clients measured (``measured(r − 1)``, the training state's
    :attr:`~fedray.engine.training.TrainingState.client_losses`) went into the
    clock's history as their statistical utility: a selector that reads it
    picks round r from round r − 1's losses. A round clocked stays clocked: a
    replay (after an actor lost its clients' states) gets the same clients. The
    uniform and Poisson selectors read no loss, and their rounds are the ones
    clocked all before training. Each round's uploads are summed into one
    aggregate of its scheduled clients, by ``postprocessing``'s protocol.
    """

    def __init__(self, clock: RunClock, schedule: Sequence[np.ndarray], tasks: TrainingTasks, first_round: int,
                 stage: str, sizes: np.ndarray, measured: Callable[[int], ClientLosses | None] = lambda number: None,
                 postprocessing: Postprocessing = Postprocessing()) -> None:
        """Rounds numbered after ``first_round`` rounds of the run; ``sizes``: the clients' samples (|B| of their
        utility)."""
        self.clock, self.schedule, self.tasks, self.first_round, self.stage = clock, schedule, tasks, first_round, stage
        self.sizes, self.measured, self.postprocessing = sizes, measured, postprocessing
        self.start_s = clock.now
        """When the first round starts (the clock's present when training begins)."""
        self.records: list[ClockedRound] = []
        """The rounds clocked so far, in order."""

    def __len__(self) -> int:
        return len(self.schedule)

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        """The clients that train in round ``index + 1`` (its kept uploads, in the selector's order)."""
        if isinstance(index, slice):
            return [self.record(position).clients for position in range(*index.indices(len(self)))]
        return self.record(index).clients

    def record(self, index: int) -> ClockedRound:
        """Round ``index + 1`` on the clock, clocking the rounds up to it that are not yet."""
        if not 0 <= index < len(self):
            raise IndexError(f"training has {len(self)} rounds, not a round {index + 1}")
        while len(self.records) <= index:
            self._clock_next()
        return self.records[index]

    def _clock_next(self) -> None:
        number = len(self.records) + 1
        losses = self.measured(number - 1)
        if losses is not None:
            self.clock.history.measured(losses.clients, self.sizes[losses.clients], losses.squares)
        scheduled = self.schedule[number - 1]
        protocol = self.postprocessing.protocol_cost(len(scheduled), self.tasks.values)
        self.records.append(self.clock.round(self.first_round + number, self.stage, scheduled,
                                             partial(self.tasks.costs, protocol=protocol),
                                             lambda clients: self.tasks.steps[clients]))

    def per_round(self, read: Callable[[ClockedRound], T]) -> Sequence[T]:
        """``read`` of each round's record, as the round loop asks for it (round ``index + 1`` at ``[index]``)."""
        return _PerRound(self, read)

    def every_s(self, every_s: float) -> Container[int]:
        """The rounds evaluated every ``every_s`` virtual seconds, as the round loop asks after each: round 0 (the
        initial model), the first round ending at or after each multiple of ``every_s`` (since the run's start), and
        the last (:func:`~fedray.clock.run_clock.evaluated_rounds`'s rule, one round at a time)."""
        return _EverySeconds(self, every_s)


@dataclass(frozen=True)
class _PerRound(Sequence[T]):
    rounds: ClockedTraining
    read: Callable[[ClockedRound], T]

    def __len__(self) -> int:
        return len(self.rounds)

    def __getitem__(self, index):  # type: ignore[override]  # the round loop asks by round, never by slice
        return self.read(self.rounds.record(index))


@dataclass(frozen=True)
class _EverySeconds(Container[int]):
    rounds: ClockedTraining
    every_s: float

    def __contains__(self, number: object) -> bool:
        if not isinstance(number, int) or not 0 <= number <= len(self.rounds):
            return False
        if number in (0, len(self.rounds)):
            return True
        end = self.rounds.record(number - 1).end_s
        previous = self.rounds.start_s if number == 1 else self.rounds.record(number - 2).end_s
        return math.floor(end / self.every_s) > math.floor(previous / self.every_s)


@dataclass(frozen=True)
class ClientTasks:
    """Each client's task in a round of a stage after training (a calibration, the ridge probe, TCT's stage 2): the
    multiply-adds of its pass and the bytes it downloads and uploads, each one amount for every client or one per
    client of the federation, and the values of its upload's aggregate (what a secure sum masks)."""

    macs: Amount
    down_bytes: Amount = 0.0
    up_bytes: Amount = 0.0
    values: int = 0

    @classmethod
    def closed_form(cls, method: ClosedFormMethod, federation: Federation) -> ClientTasks:
        """A closed form's statistics after training (what a calibration's accounting counts: their FLOPs / 2 and
        its upload; nothing downloaded)."""
        tasks = ClosedFormTasks.of(method, federation, None)
        return cls(tasks.macs, 0.0, tasks.up_bytes, tasks.values)

    def costs(self, clients: np.ndarray, protocol: TaskCost | None = None) -> TaskCost:
        """The task of ``clients``, with ``protocol`` (the postprocessors', :meth:`Postprocessing.protocol_cost`: its
        bytes sent in place of the plain upload's)."""
        macs, down, up = (_of_clients(amount, clients) for amount in (self.macs, self.down_bytes, self.up_bytes))
        if protocol is None:
            return TaskCost(macs, down, up)
        return TaskCost(macs + protocol.macs, down + protocol.down_bytes, protocol.up_bytes)


def clocked_everyone(clock: RunClock, first_round: int, stage: str, tasks: ClientTasks,
                     postprocessing: Postprocessing = Postprocessing()) -> list[ClockedRound]:
    """The rounds on the clock, which they advance, of a stage that asks every client once (a calibration, the ridge
    probe, TCT's normalization and closed form), numbered after the run's ``first_round`` rounds: a round with the
    federation as the schedule's row, its uploads summed by ``postprocessing``'s protocol in one aggregate of every
    client, then the hearing loop's (:func:`clocked_closed_form`) until every client is heard."""
    return clocked_closed_form(clock, [np.arange(clock.num_clients, dtype=np.int64)], tasks, stage, postprocessing,
                               None, first_round)


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

    def everyone(self, first_round: int, stage: str, tasks: ClientTasks,
                 postprocessing: Postprocessing) -> list[ClockedRound]:
        """The rounds of a round of every client (:func:`clocked_everyone`), which advance the clock."""
        records = clocked_everyone(self.clock, first_round, stage, replace(tasks, macs=self._with_pass(tasks.macs)),
                                   postprocessing)
        for record in records:
            self.passed[record.clients] = True
        return records

    def round(self, number: int, stage: str, scheduled: np.ndarray, tasks: ClientTasks,
              postprocessing: Postprocessing) -> ClockedRound:
        """Round ``number`` of ``stage`` from the schedule's row ``scheduled``, which advances the clock; its uploads
        summed into one aggregate of its scheduled clients by ``postprocessing``'s protocol."""
        protocol = postprocessing.protocol_cost(len(scheduled), tasks.values)

        def costs(clients: np.ndarray) -> TaskCost:
            return tasks.costs(clients, protocol) + TaskCost(np.where(self.passed[clients], 0.0,
                                                                      self.first_macs[clients]))

        record = self.clock.round(number, stage, scheduled, costs)
        self.passed[record.clients] = True
        return record

    def _with_pass(self, macs: Amount) -> np.ndarray:
        """Every client's ``macs`` and the pass where it has not made it yet."""
        return macs + np.where(self.passed, 0.0, self.first_macs)


def clocked_closed_form_uploads(stage: str, sampling: Sampling, rounds: Sequence[np.ndarray],
                                evaluate_at: Container[int], summed: bool = True) -> StageUploads:
    """A closed form's uploads on the clock (the clients its rounds keep, numbered from 1): each client's first kept
    upload, summed an evaluation block at a time, the blocks ending at the rounds of ``evaluate_at`` (as
    :class:`~fedray.engine.closed_form.ClosedFormRounds` forms them); ``group`` and ``smallest_group`` are the most and
    fewest uploads of a block with any. ``summed``: the method's :attr:`~fedray.ClosedFormMethod.uploads_summed`."""
    seen = np.zeros(sampling.population, dtype=bool)
    blocks, uploads = [], 0
    for number, clients in enumerate(rounds, start=1):
        new = clients[~seen[clients]]  # a round's clients are distinct
        seen[new] = True
        uploads += len(new)
        if number in evaluate_at:
            blocks.append(uploads)
            uploads = 0
    sizes = [size for size in blocks if size] or [0]
    return StageUploads(stage, False, sampling, len(rounds), max(sizes), min(sizes), summed)
