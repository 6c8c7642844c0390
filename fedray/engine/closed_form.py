"""A closed-form method's rounds: upload (accounted), reduce in the shards, solve, evaluate."""

from __future__ import annotations

import time
import uuid
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from fedray.core.accounting import PaperTotals
from fedray.core.federation import Federation
from fedray.runtime.evaluator import Evaluator, PendingAccuracy
from fedray.methods.base import FLOAT_BYTES, Classifier, ClosedFormMethod
from fedray.methods.checks import check_classifier, combine_checked, statistics_finite
from fedray.methods.postprocessor import Postprocessing, StageUploads
from fedray.core.reports import reporting
from fedray.core.results import EvalPoint
from fedray.engine.callbacks import Callbacks
from fedray.engine.config import COLUMNS
from fedray.engine.parts import MethodSpec, closed_form_uploads
from fedray.engine.pipeline import RunPlan, Stage, StageContext, StageResult
from fedray.engine.clocked import (ClockColumns, ClockedPass, ClosedFormTasks, clocked_closed_form,
                                  clocked_closed_form_uploads)
from fedray.engine.round_loop import Callback, EvalRounds, Listener, Report, run_rounds
from fedray.runtime.actor_group import Reduction, combine_partials
from fedray.runtime.footprint import Footprint, largest_clients
from fedray.runtime.shard_statistics import WithSecondPasses, same_request
from fedray.runtime.shards import ShardPool


BLOCKS_AHEAD = 2
"""Blocks whose statistics the shards are given beyond the one the driver solves: enough that they never wait for a
solve, few enough that the blocks' sums do not pile up in the object store (the driver maps each it reads: a run's
every block at once grew the driver by two C × d partial sums an evaluation, FedCOF's 300 MB at ten)."""


@dataclass
class RunOutcome:
    points: list[EvalPoint] = field(default_factory=list)
    classifier: Classifier | None = None
    rounds: Sequence[np.ndarray] = ()
    """The clients of each round: round r's are ``rounds[r - 1]``."""
    solve_s: float = 0.0
    eval_s: float = 0.0
    paper: PaperTotals = field(default_factory=PaperTotals)
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """The clients of ``rounds`` whose statistics never reached the server (secure aggregation's dropouts): not seen."""


@dataclass
class _Block:
    round: int
    clients_seen: int
    samples_seen: int
    bytes_up: float
    flops_client_avg: float
    paper: dict[str, float | None]
    total: Reduction | None
    uploads: int = 0
    postprocessing: Postprocessing | None = None  # the run's, among the block's uploaders
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """The block's uploaders whose statistics never reached the server (:meth:`Postprocessing.dropped`)."""
    accuracy: PendingAccuracy | None = None
    classifier: Classifier | None = None
    reported: dict[str, float | str] = field(default_factory=dict)


class ClosedFormRounds:
    """A closed-form method's rounds for :func:`~fedray.engine.round_loop.run_rounds`.

    A client uploads its statistics the first time it is sampled and never
    again (the clients of one round are distinct). The uploads are given to
    the shards :data:`BLOCKS_AHEAD` evaluation blocks ahead of the one the
    driver solves, one reduction per block, so shards compute later blocks
    while the driver solves and evaluates earlier ones; a round itself has
    nothing left to do. The driver solves one block ahead: it queues the next
    block's evaluation before it waits for this one's, so the shards never
    wait for a solve.
    """

    def __init__(self, pool: ShardPool, method: ClosedFormMethod, rounds: Sequence[np.ndarray],
                 evaluate_at: Container[int],
                 evaluator: Evaluator, outcome: RunOutcome, backbone_macs: float | None = None,
                 postprocessing: Postprocessing = Postprocessing()) -> None:
        self.method, self.evaluator, self.outcome, self.backbone_macs = method, evaluator, outcome, backbone_macs
        self.postprocessing = postprocessing
        federation = pool.federation
        self.num_classes = federation.num_classes
        self.width = method.transform(torch.zeros(1, federation.dim)).shape[-1]
        """The width of the features after the method's transform: the rows of its classifier's weight."""
        self.start = time.perf_counter()
        self.pool, self.method_ref, self.token = pool, ray.put(method), uuid.uuid4().hex
        self.uploads: list[tuple[int, np.ndarray]] = []
        """Each block's tag and uploading clients, for a method that keeps a part of them in the shards."""
        self.requests_ahead: dict[int, Any] = {}
        """Each evaluation's second-pass request, where the shards compute it with the statistics (see
        :meth:`_requests_ahead`)."""
        self.second_passes: dict[int, Any] = {}
        """Each evaluation's second pass over the blocks solved so far, added block after block."""
        """Whether the shards sum each evaluation's second pass as they compute the statistics
        (:meth:`_requests_ahead`)."""
        self.unsubmitted: list[tuple[int, np.ndarray, Postprocessing, np.ndarray, list[tuple[int, Any]] | None]] = []
        """The blocks with uploads not yet given to the shards, in order: tag, clients, postprocessing, rounds, the
        second-pass requests they sum ahead."""
        self.blocks = self._submit(pool, self.method_ref, rounds, evaluate_at)
        self.following = dict(zip(sorted(self.blocks), sorted(self.blocks)[1:]))
        if self.blocks:
            self._submit_ahead(min(self.blocks))
        self.state: Any = None
        self.reported: dict[str, float | str] = {}
        """The last number each plugin reported by name (:func:`fedray.report`)."""
        self.accuracy = float("nan")
        self.evaluated: Classifier | None = None

    def _submit(self, pool: ShardPool, method_ref: ray.ObjectRef, rounds: Sequence[np.ndarray],
                evaluate_at: Container[int]) -> dict[int, _Block]:
        federation, method = pool.federation, self.method
        sizes = federation.client_sizes
        upload_bytes = method.upload_floats(federation) * FLOAT_BYTES
        client_flops = method.statistics_flops(sizes.astype(np.float64))
        paper_costs, paper = method.paper_costs(federation), self.outcome.paper
        seen = np.zeros(federation.num_clients, dtype=bool)
        blocks: dict[int, _Block] = {}
        uploads: list[np.ndarray] = []
        upload_rounds: list[np.ndarray] = []
        bytes_up = flops = 0.0
        samples = clients_seen = 0
        for number, clients in enumerate(rounds, start=1):
            new = clients[~seen[clients]]
            seen[new] = True
            uploads.append(new)
            upload_rounds.append(np.full(len(new), number))
            if number not in evaluate_at:
                continue
            uploaded, when = np.concatenate(uploads), np.concatenate(upload_rounds)
            group = self.postprocessing.among(uploaded, number)
            lost = group.dropped(number) if len(uploaded) else np.zeros(0, dtype=np.int64)
            for new in uploads:  # counted round by round, the uploads that reached the server as received
                received = new[~np.isin(new, lost)] if len(lost) else new
                bytes_up += float(upload_bytes[received].sum())
                flops += float(client_flops[new].sum())
                paper.add(paper_costs, new, self.backbone_macs, received)
                samples += int(sizes[received].sum())
                clients_seen += len(received)
            uploads, upload_rounds = [], []
            if len(uploaded):
                self.unsubmitted.append((number, uploaded, group, when, None))
                self.uploads.append((number, uploaded))
            blocks[number] = _Block(number, clients_seen, samples, bytes_up, flops / max(clients_seen, 1),
                                    paper.columns(federation.num_clients), None, len(uploaded), group, lost)
        ahead = self._requests_ahead(pool, method_ref)
        self.requests_ahead = {} if ahead is None else dict(ahead)
        if ahead is not None:
            self.unsubmitted = [(number, uploaded, group, when, [(evaluation, request) for evaluation, request in ahead
                                                                 if evaluation >= number])
                                for number, uploaded, group, when, _ in self.unsubmitted]
        return blocks

    def _submit_ahead(self, number: int) -> None:
        """Give the shards the statistics of the blocks up to :data:`BLOCKS_AHEAD` after block ``number``."""
        order = sorted(self.blocks)
        last = order[min(order.index(number) + BLOCKS_AHEAD, len(order) - 1)]
        while self.unsubmitted and self.unsubmitted[0][0] <= last:
            tag, uploaded, group, when, later = self.unsubmitted.pop(0)
            self.blocks[tag].total = self.pool.statistics(self.method, uploaded, self.method_ref, group, when,
                                                          (self.token, tag), later)

    def _requests_ahead(self, pool: ShardPool, method_ref: ray.ObjectRef) -> list[tuple[int, Any]] | None:
        """Each evaluation's second-pass request, known before the pass from the labels of the clients that upload up to
        it (:meth:`~fedray.ClosedFormMethod.label_statistics`, counted in the shards), so that the shards read each
        part they would keep once, computing its second pass for every later evaluation with the block's statistics;
        None where the method cannot tell them, or a postprocessor changes uploads (the server then receives other
        counts than the labels')."""
        if type(self.method).label_statistics is ClosedFormMethod.label_statistics or self.postprocessing.per_client \
                or not self.uploads:
            return None
        counted = pool.label_statistics(self.method, method_ref, [clients for _, clients in self.uploads])
        total, ahead = None, []
        for (number, _), block in zip(self.uploads, counted):
            total = block if total is None else combine_checked(self.method, total, block)
            request = self.method.second_pass_request(total)
            if request is None:
                return None
            ahead.append((number, request))
        return ahead

    def _solve(self, block: _Block) -> None:
        """Add ``block``'s sums to the state, solve, and queue the classifier's evaluation (once per block with uploads)."""
        self._submit_ahead(block.round)
        if block.total is None:
            block.reported = dict(self.reported)
            return
        partial, block.total = block.total.result(), None  # its sums go into the state: the store may free them
        if isinstance(partial, WithSecondPasses):
            ahead = [evaluation for evaluation in self.requests_ahead if evaluation >= block.round]  # as submitted
            for evaluation, second in zip(ahead, partial.second_passes):
                self.second_passes[evaluation] = combine_partials(self.second_passes.get(evaluation), second,
                                                                  self.method.combine_second)
            partial = partial.statistics
        with reporting(self.reported, COLUMNS):
            partial = block.postprocessing.aggregate(partial, block.round, block.uploads, self.method.upload_parts())
            solve_start = time.perf_counter()
            self.state = partial if self.state is None else combine_checked(self.method, self.state, partial)
            state = self.state
            solved = self._solved(state, block.round)
        block.reported = dict(self.reported)
        classifier = check_classifier(self.method, solved, self.width, self.num_classes, block.round,
                                      lambda: statistics_finite(state))
        self.outcome.classifier = block.classifier = classifier
        self.outcome.solve_s += time.perf_counter() - solve_start
        block.accuracy = self.evaluator.submit(self.method, self.outcome.classifier)

    def _solved(self, state: Any, round_number: int) -> Classifier:
        """The method's solve of ``state``, after the second pass over what the shards kept up to ``round_number`` if
        it asks for one."""
        request = self.method.second_pass_request(state)
        if request is None:
            return self.method.solve(state)
        summed = self.second_passes.pop(round_number, None)
        if round_number in self.requests_ahead and same_request(request, self.requests_ahead[round_number]):
            return self.method.solve_second(state, summed)
        uploads = [(tag, clients) for tag, clients in self.uploads if tag <= round_number]
        second = self.pool.second_pass(self.method, self.method_ref, request, self.token, uploads,
                                       self.postprocessing.per_client)
        return self.method.solve_second(state, second)

    def finish(self) -> None:
        """Free what the run kept in the shards."""
        self.pool.forget(self.token)

    def run_round(self, number: int, clients: np.ndarray) -> bool:
        return True

    def classifier(self) -> Classifier | None:
        """The classifier solved for the last row (a block without uploads keeps the one before; None before any)."""
        return self.evaluated

    def point(self, number: int, diverged: bool = False) -> EvalPoint:
        block = self.blocks[number]
        self._solve(block)
        if number in self.following:
            self._solve(self.blocks[self.following[number]])
        if block.accuracy is not None:
            eval_start = time.perf_counter()
            self.accuracy = block.accuracy.result()
            self.outcome.eval_s += time.perf_counter() - eval_start
            self.evaluated, block.classifier = block.classifier, None
        return EvalPoint(block.round, block.clients_seen, block.samples_seen, self.accuracy, block.bytes_up, 0.0,
                         block.flops_client_avg, time.perf_counter() - self.start, **block.paper, reported=block.reported)


def run_closed_form(
    pool: ShardPool,
    method: ClosedFormMethod,
    rounds: Sequence[np.ndarray],
    eval_every: int,
    evaluator: Evaluator,
    on_point: Listener | None = None,
    backbone_macs: float | None = None,
    postprocessing: Postprocessing = Postprocessing(),
    callbacks: Callbacks | None = None,
    evaluate_at: Container[int] | None = None,
    clock: Callback | None = None,
) -> RunOutcome:
    """Run ``method`` over ``rounds``; one :class:`EvalPoint` per evaluation, also passed to ``on_point`` with the
    classifier solved there.

    ``backbone_macs`` is the backbone's forward multiply-adds per sample (F_φ),
    when known, for ``macs_client_avg_fed3r``. A researcher's ``callbacks`` may stop the rounds at an evaluation
    row: the outcome's rounds end there. ``evaluate_at``: the rounds evaluated, when not every ``eval_every``-th
    and the last (``--eval-every-s``); ``clock``: the clock's columns, added to each row first.
    """
    callbacks = callbacks or Callbacks()
    outcome = RunOutcome(rounds=rounds)
    evaluate_at = EvalRounds(len(rounds), eval_every) if evaluate_at is None else evaluate_at
    path = ClosedFormRounds(pool, method, rounds, evaluate_at, evaluator, outcome, backbone_macs, postprocessing)
    name = method.name or type(method).__name__
    try:
        first = [] if clock is None else [clock]
        run_rounds(path, rounds, evaluate_at, [*first, Report(outcome.points, on_point, path.classifier),
                                               callbacks.loop("closed_form", name, len(rounds))])
    finally:
        path.finish()
    last = outcome.points[-1].round
    outcome.rounds = rounds[:last]
    outcome.dropped = np.concatenate([block.dropped for number, block in path.blocks.items() if number <= last])
    return outcome


def everyone_uploads(pool: ShardPool, method: ClosedFormMethod, postprocessing: Postprocessing,
                     round_number: int) -> tuple[Any, np.ndarray]:
    """One round in which every client uploads ``method``'s statistics (SphereFed's calibration, the ridge probe):
    their sum as the server receives it, through the run's postprocessors, and the clients whose uploads never reached
    it (:meth:`~fedray.methods.postprocessor.Postprocessing.dropped`: secure aggregation's dropouts)."""
    everyone = np.arange(pool.federation.num_clients)
    uploads = postprocessing.sampled(len(everyone), len(everyone), False).among(everyone, round_number)
    total = pool.statistics(method, everyone, postprocessing=uploads, rounds=np.full(len(everyone), round_number)).result()
    return uploads.aggregate(total, round_number, len(everyone), method.upload_parts()), uploads.dropped(round_number)


@dataclass(frozen=True)
class ClosedForm(Stage):
    """A closed-form stage: ``method`` through the shards over ``rounds`` rounds (None: until every client was seen),
    evaluated every ``--eval-every``; on its own the run's classifier, or ``--init``'s inside training
    (:class:`~fedray.engine.stages.Training`), whose head it becomes."""

    method: MethodSpec
    rounds: int | None
    built: dict[int, ClosedFormMethod] = field(default_factory=dict, compare=False, repr=False)
    """The method built on a federation (by its id): once, before any work, to refuse a bad option first."""
    planned: dict[int, ClockedPass] = field(default_factory=dict, compare=False, repr=False)
    """Its rounds on a run's clock (by the clock's id): clocked once, before any work where the plan knows its
    features (:meth:`plan_clock`), so that the postprocessors are told its upload groups as the evaluation points in
    virtual time make them."""

    def build(self, federation: Federation) -> ClosedFormMethod:
        """The method on ``federation``'s features, built once."""
        if id(federation) not in self.built:
            self.built[id(federation)] = self.method.build(federation)
        return self.built[id(federation)]

    def check(self, run: RunPlan, federation: Federation) -> None:
        method = self.build(federation)
        if run.clock is not None:
            run.clock.check(ClosedFormTasks.of(method, federation, run.backbone_macs).cost())
            self.plan_clock(run, federation)

    def plan_clock(self, run: RunPlan, federation: Federation) -> None:
        """Its rounds on the run's clock (which they advance), before any work, on ``federation``'s features with the
        run's F_φ: a closed form is a run's first stage, and who uploads in each of its rounds is known before any
        runs."""
        self.clocked(run, federation, self.build(federation), run.backbone_macs)

    def uploads(self, run: RunPlan, label: str = "closed form") -> tuple[StageUploads, ...]:
        """Its blocks' uploads: on the clock, where its rounds are planned, those of the blocks its evaluation points
        in virtual time (or every ``--eval-every`` rounds) make; else as ``--eval-every`` makes them."""
        summed = self.method.cls.uploads_summed
        if run.clock is not None and id(run.clock) in self.planned:
            planned = self.planned[id(run.clock)]
            every_s = run.clock.evaluate_at(planned.ends, planned.start_s)
            evaluate_at = EvalRounds(len(planned.rounds), run.eval_every) if every_s is None else every_s
            return (clocked_closed_form_uploads(label, run.sampler.drawn, planned.rounds, evaluate_at, summed),)
        return (closed_form_uploads(label, run.sampler.drawn, len(run.rounds(self.rounds)), run.eval_every, summed),)

    def footprints(self, run: RunPlan, federation: Federation, label: str | None = None) -> tuple[Footprint, ...]:
        block = largest_clients(federation, run.sampler.per_round * run.eval_every)
        return (self.method.footprint(label or self.method.name, federation, federation.dim, block,
                                      run.shards.kept_budget),)

    def solve(self, context: StageContext, method: ClosedFormMethod, pool: ShardPool, evaluator: Evaluator,
              backbone_macs: float | None) -> RunOutcome:
        """The method's rounds on ``pool``'s features, every upload through the run's postprocessing."""
        run = context.run
        evaluate_at = columns = None
        postprocessing = run.sampler.uploads(context.postprocessing)
        if run.clock is None:
            rounds: Sequence[np.ndarray] = run.rounds(self.rounds)
        else:
            planned = self.clocked(run, pool.federation, method, backbone_macs)
            rounds = planned.rounds
            evaluate_at = run.clock.evaluate_at(planned.ends, planned.start_s)
            columns = ClockColumns(run.clock)
        return run_closed_form(pool, method, rounds, run.eval_every, evaluator,
                               on_point=context.on_point, backbone_macs=backbone_macs,
                               postprocessing=postprocessing, callbacks=context.callbacks,
                               evaluate_at=evaluate_at, clock=columns)

    def clocked(self, run: RunPlan, federation: Federation, method: ClosedFormMethod,
                backbone_macs: float | None) -> ClockedPass:
        """Its rounds on the run's clock, which they advance the first time they are asked (:attr:`planned`): who
        uploads in each, known before any runs; each evaluation block's uploads summed together by the run's
        postprocessing's protocol."""
        if id(run.clock) not in self.planned:
            # drawn for the planning alone, not kept with the run's (:meth:`RunPlan.rounds`): the pass keeps its own
            # rounds, and the sampler's permutation it read (8 MB at a million clients) goes with this schedule
            schedule = run.sampler.rounds(self.rounds)
            blocks = None if run.clock.every_s is not None else EvalRounds(len(schedule), run.eval_every)
            self.planned[id(run.clock)] = ClockedPass.of(run.clock.now, clocked_closed_form(
                run.clock, schedule, ClosedFormTasks.of(method, federation, backbone_macs), "closed_form",
                run.sampler.uploads(run.postprocessing), blocks))
        return self.planned[id(run.clock)]

    def run(self, context: StageContext, previous: StageResult) -> StageResult:
        """The run's classifier: its rows, its rounds and its arrays (with the method's own, a random feature map);
        what the method resolved is the run's record."""
        method = self.build(context.federation)
        outcome = self.solve(context, method, context.pool, context.evaluator, context.run.backbone_macs)
        resolved = {"num_shards": context.pool.num_shards, **method.recorded()}
        return StageResult(outcome.points, rounds=outcome.rounds, resolved=resolved,
                           arrays={**outcome.classifier.arrays(), **method.arrays()})
