"""TCT end to end (Yu et al., NeurIPS 2022): train, convexify, train.

1. Stage 1: ``--base`` (FedAvg by default) fine-tunes the network on images
   (``--finetune``, ``ft`` by default) for ``--rounds`` rounds: the usual
   ``train`` rows.
2. The trainers compute every sample's eNTK features at the stage-1 weights
   (last layer replaced by a one-output head initialized from the run's seed,
   ``--entk-dim`` coordinates drawn from the run's seed; see
   :mod:`fedray.methods.entk`) and leave them in the object store; the
   trainers stop and stage-2 shards start on the same client ranges with the
   features handed over (and projected to ``--tct-projection`` coordinates
   when given): they never reach the driver.
3. One normalization round (every client uploads n_k, Σ z, Σ z²), unless
   ``--tct-no-normalization``: then no round, and stage 2 runs on the raw
   features (its μ = 0 and σ = 1, and its rounds are numbered one earlier).
4. Stage 2 on the standardized features with a bias (the paper's Algorithm 2:
   ψ = (W, b), scores Z̃W + 1bᵀ; a constant-1 coordinate appended to the
   features, see :mod:`fedray.methods.tct_stage2`), by ``--tct-solver``:
   ``scaffold`` (TCT's communication-efficient SCAFFOLD, ``--tct-rounds`` of
   ``--tct-local-steps`` full-batch steps at ``--tct-lr``: ``tct_scaffold``
   rows, whose ``train_loss`` is the stage-2 objective F at each round's
   start over its clients), ``closed_form`` (one upload of XᵀX and XᵀY, the
   exact minimizer: one ``tct_closed_form`` row, ``train_loss`` = F at the
   minimizer, the floor SCAFFOLD's approaches) or ``both``, each branching from the
   normalization round: the closed form's row counts stage 1, the eNTK and
   normalization costs and its own upload, not SCAFFOLD's rounds.

TCT's ablations (§5.4, App. B.7) are options of the same stages:
``--tct-fedavg`` (SCAFFOLD without control variates: FedAvg, c never sent),
``--tct-no-normalization``, ``--tct-loss ce`` (softmax cross-entropy instead of
the squared loss; no closed form) and ``--entk-params last_layer`` (the gradient
w.r.t. the head's weight only: the penultimate features).

Every upload of every stage (stage 1's training, the normalization round, the
closed form's statistics, each SCAFFOLD round's Δ_k and c_k⁺ − c_k) passes
through the run's postprocessing, numbered with the run's rounds: the
normalization is round R + 1 after stage 1's R, the closed form R + 2 and
SCAFFOLD's round r R + 1 + r (both solvers branch from the normalization, as
their rows do; one less each without the normalization round); the first two are every client once, SCAFFOLD samples κ of K
with replacement. The rows count the uploads that reached the server (not a secure aggregation's dropouts:
:meth:`~fedray.Postprocessor.dropped`), and the closed form's N is the samples of the statistics it received.

On the run's clock each of stage 2's rounds is a round of the clock (its selector, availability and deadline), a
client's task the FLOPs / 2 and the floats its accounting counts: the normalization round (stage ``tct_normalization``
in rounds.parquet; every client: 3·n_k·p FLOPs, 2p + 1 floats up, μ and σ's 2p down), the closed form's
(``tct_closed_form``; every client: 2·n_k·(p + 1)·(p + 1 + C) FLOPs, its statistics up) and SCAFFOLD's
(``tct_scaffold``, κ clients drawn with replacement: 4·steps·n_k·(p + 1)·C FLOPs, Δ_k up, ψ and c down), a
client's eNTK features (and their projection) counted in its first task of the stage. With ``both`` the closed
form's round comes first on the clock, then SCAFFOLD's rounds, numbered from the same round as their rows are;
``--stragglers partial`` drops a late stage-2 client (its full-batch steps are not cut).

The outcome's arrays (``classifier.npz``) hold each solver's weights and bias
separately: ``W`` (p × C) and ``bias`` (C), SCAFFOLD's when it ran, and with
``both`` the closed form's as ``W_closed_form`` and ``bias_closed_form``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass, replace

import numpy as np
import ray
import torch

from fedray.core.federation import TEST, TRAIN, Federation
from fedray.core.reports import reporting
from fedray.core.results import EvalPoint
from fedray.engine.callbacks import Callbacks
from fedray.engine.clocked import ClientTasks, ClockColumns, FirstPassClock
from fedray.engine.config import COLUMNS
from fedray.engine.parts import Sampler, training_uploads, uploads_of_everyone
from fedray.engine.pipeline import RunPlan, Stage, StageContext, StageResult
from fedray.engine.round_loop import Callback, EvalRounds, Listener, Report, run_rounds
from fedray.engine.training import Accounting
from fedray.methods.base import FLOAT_BYTES, Classifier
from fedray.methods.postprocessor import Postprocessing, StageUploads
from fedray.methods.tct_stage2 import TctStage2Options, objective_from_statistics, split_model
from fedray.runtime import sampling
from fedray.runtime.schedules import Schedule
from fedray.runtime.tct_shards import LocalSolver, Normalization, Projection, Stage2Pool


@dataclass(frozen=True)
class TctStage2(Stage):
    """TCT's stage 2 on the eNTK features at the stage-1 weights the training before it leaves (see the module's
    docstring), as its ``options`` say: SCAFFOLD's rounds, the closed form or both, on the features or a projection
    of them."""

    options: TctStage2Options

    def check(self, run: RunPlan, federation: Federation) -> None:
        sampling.check_rounds(self.options.rounds, "--tct-rounds")

    def uploads(self, run: RunPlan) -> tuple[StageUploads, ...]:
        told = []
        if self.options.normalized:
            told.append(uploads_of_everyone("tct normalization", run.sampler))
        if self.options.solves_closed_form:
            told.append(uploads_of_everyone("tct closed form", run.sampler))
        if self.options.solves_iteratively:
            told.append(training_uploads("tct stage 2", run.sampler.drawn, self.options.rounds))
        return tuple(told)

    def run(self, context: StageContext, previous: StageResult) -> StageResult:
        """The eNTK features at stage 1's weights (``previous``'s, on its trainers, which then stop), stage 2; the
        result's arrays hold stage 2's models. Inside a Tune trial stage 2's shards run in the trial's bundles. Every
        upload passes through the run's postprocessing (its state carries from stage 1, which has no checkpoint)."""
        if previous.points[-1].diverged or context.callbacks.stopping:
            return previous
        run, federation, backend, options = context.run, context.federation, previous.backend, self.options
        spec = options.entk_spec(backend.entk_head, backend.entk_num_parameters, run.seed)
        index = spec.index
        params = ray.put(previous.params)
        train, train_labels = backend.pool.entk(params, spec, TRAIN)
        test, test_labels = backend.pool.entk(params, spec, TEST)
        # Each client computes its samples' eNTK features
        sizes = federation.client_sizes.astype(np.float64)
        entk_flops = options.entk_passes * backend.flops_per_image * sizes
        previous.accounting.flops += options.entk_passes * backend.flops_per_image * float(sizes.sum())
        bounds, bundle = backend.pool.bounds, backend.pool.bundle
        context.release(backend)
        projection = Projection.of(options, run.seed)
        width = len(index) if projection is None else projection.dim
        pool = Stage2Pool.start(train, train_labels, test, test_labels, bounds, federation.client_offsets,
                                federation.num_classes, bundle, projection, context.trial_group)
        if projection is not None:
            entk_flops = entk_flops + 2.0 * sizes * len(index) * width
        clock = None if run.clock is None else FirstPassClock(run.clock, entk_flops / 2)
        try:
            stage2 = Stage2Run(self, run.sampler, run.eval_every, pool, federation.client_sizes,
                               federation.num_classes, width, previous.points, previous.accounting, context.on_point,
                               context.postprocessing, clock)
            if projection is not None:
                stage2.accounting.flops += 2.0 * float(federation.client_sizes.sum()) * len(index) * width
            normalization = stage2.normalize()
            closed_form = stage2.closed_form(normalization) if options.solves_closed_form else None
            scaffold = stage2.scaffold(normalization, context.callbacks) if options.solves_iteratively else None
        finally:
            pool.shutdown()
        # W and bias are SCAFFOLD's when it ran, else the closed form's; with both, the closed form's are suffixed.
        solved = {"": scaffold if scaffold is not None else closed_form}
        if scaffold is not None and closed_form is not None:
            solved["_closed_form"] = closed_form
        arrays = {f"{name}{suffix}": array for suffix, model in solved.items()
                  for name, array in stage2_classifier(model).arrays().items()}
        arrays.update({"entk_index": index.numpy(), "entk_mean": stage2.normalization.mean.numpy(),
                       "entk_std": stage2.normalization.std.numpy()})
        return replace(previous, arrays=arrays, rounds=previous.rounds + stage2.rounds(scaffold is not None))


class Stage2Run:
    """Stage 2's rows and accounting after stage 1, on a started :class:`Stage2Pool`."""

    def __init__(self, stage: TctStage2, sampler: Sampler, eval_every: int, pool: Stage2Pool,
                 sizes: np.ndarray, num_classes: int, width: int, points: list[EvalPoint], accounting: Accounting,
                 on_point: Listener | None = None, postprocessing: Postprocessing = Postprocessing(),
                 clock: FirstPassClock | None = None) -> None:
        """``clock``: stage 2's rounds on the run's clock, its first pass each client's eNTK features (None: no
        clock)."""
        self.stage, self.sampler, self.eval_every = stage, sampler, eval_every
        self.clock = clock
        self.pool, self.sizes, self.num_classes, self.width = pool, sizes, num_classes, width
        self.points, self.accounting, self.on_point, self.postprocessing = points, accounting, on_point, postprocessing
        self.first_round = points[-1].round
        self.solvers_start = self.first_round + (1 if stage.options.normalized else 0)
        """The run's rounds before the solvers': stage 1's and the normalization round when there is one (on the
        clock, its rounds)."""
        everyone = np.arange(len(sizes))
        self.normalization_rounds = [everyone] if stage.options.normalized else []
        """The clients of the normalization's rounds: every client in one (on the clock, those each round heard)."""
        self.closed_form_rounds = [everyone]
        """The clients of the closed form's rounds, as :attr:`normalization_rounds`."""
        self.everyone = postprocessing.sampled(len(sizes), len(sizes), False)
        """The uploads of the normalization round and the closed form: every client once, in the run's rounds."""
        self.started = time.perf_counter() - points[-1].wall_s
        self.normalization: Normalization | None = None
        self.scaffold_rounds = Schedule.of()
        self.scaffold_start = self.solvers_start
        """The run's rounds before SCAFFOLD's: the closed form's round is SCAFFOLD's first when both run (on the clock,
        its last)."""
        self.reported: dict[str, float | str] = dict(points[-1].reported)
        """The last number each postprocessor's aggregate reported (:func:`fedray.report`), for stage 2's rows."""

    def record(self, accounting: Accounting, round_number: int, accuracy: float, stage: str, model: torch.Tensor,
               loss: float | None = None) -> None:
        """A row of stage 2's ``model`` ψ (its classifier: W and b on the standardized eNTK features)."""
        point = accounting.point(round_number, accuracy, time.perf_counter() - self.started, stage, loss,
                                 reported=self.reported)
        if self.clock is not None:
            ClockColumns(self.clock.clock).on_point(point)
        self.points.append(point)
        if self.on_point is not None:
            self.on_point(point, stage2_classifier(model))

    def normalize(self) -> ray.ObjectRef:
        """The normalization round (2p + 1 floats up, 2p down per client); the broadcast (μ, σ) as a ref.

        Without it (``--tct-no-normalization``) μ = 0 and σ = 1, which every use of them ((z − μ)/σ in float64)
        leaves bit for bit as z: no round, nothing sent."""
        if not self.stage.options.normalized:
            self.normalization = Normalization(torch.zeros(self.width, dtype=torch.float64),
                                               torch.ones(self.width, dtype=torch.float64))
            return ray.put(self.normalization)
        everyone, round_number = np.arange(len(self.sizes)), self.first_round + 1
        if self.clock is not None:
            records = self.clock.everyone(self.first_round, "tct_normalization",
                                          ClientTasks(1.5 * self.sizes * self.width, 2 * self.width * FLOAT_BYTES,
                                                      (2 * self.width + 1) * FLOAT_BYTES, 2 * self.width + 1),
                                          self.postprocessing)
            self.normalization_rounds = [record.clients for record in records]
            self.solvers_start = self.scaffold_start = records[-1].number
        uploads = self.everyone.among(everyone, round_number)
        with reporting(self.reported, COLUMNS):  # a postprocessor's aggregate may report
            normalization = self.pool.normalization(uploads=uploads, round_number=round_number)
        received = np.setdiff1d(everyone, uploads.dropped(round_number))
        clients = len(self.sizes)
        samples = float(self.sizes.sum())
        self.accounting.add(everyone, self.sizes, len(received) * (2 * self.width + 1) * FLOAT_BYTES,
                            clients * 2 * self.width * FLOAT_BYTES, 3.0 * samples * self.width, received=received)
        self.normalization = normalization
        return ray.put(normalization)

    def closed_form(self, normalization: ray.ObjectRef) -> torch.Tensor:
        """The exact stage-2 minimizer ψ from every client's XᵀX and XᵀY ((p + 1)² + (p + 1)C floats up each), one round."""
        accounting = copy.deepcopy(self.accounting)
        everyone, round_number = np.arange(len(self.sizes)), self.solvers_start + 1
        p = self.width + 1  # the features and the intercept
        row = round_number
        if self.clock is not None:
            records = self.clock.everyone(self.solvers_start, "tct_closed_form",
                                          ClientTasks(self.sizes * float(p * (p + self.num_classes)), 0.0,
                                                      float((p * p + p * self.num_classes) * FLOAT_BYTES),
                                                      p * p + p * self.num_classes), self.postprocessing)
            self.closed_form_rounds = [record.clients for record in records]
            row = records[-1].number
            self.scaffold_start = row - 1  # with both solvers, SCAFFOLD's first round is numbered as the row
        uploads = self.everyone.among(everyone, round_number)
        with reporting(self.reported, COLUMNS):
            statistics = self.pool.statistics(normalization, uploads, round_number)
        received = np.setdiff1d(everyone, uploads.dropped(round_number))
        count = int(self.sizes[received].sum())  # N of the statistics the server received
        model = self.stage.options.solve(statistics.matrix, statistics.rhs, count)
        accounting.add(everyone, self.sizes, len(received) * (p * p + p * self.num_classes) * FLOAT_BYTES,
                       0.0, 2.0 * float(self.sizes.sum()) * p * (p + self.num_classes), received=received)
        loss = objective_from_statistics(statistics.matrix, statistics.rhs, count, self.num_classes, model)
        self.record(accounting, row, self.pool.accuracy(normalization, ray.put(model)), "tct_closed_form", model, loss)
        return model

    def scaffold(self, normalization: ray.ObjectRef, callbacks: Callbacks | None = None) -> torch.Tensor:
        """TCT's SCAFFOLD (FedAvg with ``--tct-fedavg``) from ψ = 0 ((p + 1) × C, float64 on the driver),
        ``tct_scaffold`` rows every ``--eval-every`` rounds; the run's ``callbacks`` hear its rounds (and may stop it at
        a row)."""
        sampler = replace(self.sampler, with_replacement=True)  # TCT's SCAFFOLD samples with replacement
        rounds: Sequence[np.ndarray] = sampler.rounds(self.stage.options.rounds, past_coverage=True)
        path = ScaffoldRounds(self, normalization, sampler)
        evaluate_at: Container[int] = EvalRounds(len(rounds), self.eval_every)
        first: list[Callback] = []
        if self.clock is not None:
            clock = self.clock.clock
            start_s = clock.now
            records = [self.clock.round(self.scaffold_start + number, "tct_scaffold", clients, path.tasks(),
                                        self.postprocessing) for number, clients in enumerate(rounds, start=1)]
            rounds = [record.clients for record in records]
            every_s = clock.evaluate_at([record.end_s for record in records], start_s)
            evaluate_at = evaluate_at if every_s is None else every_s
            first = [ClockColumns(clock)]
        loop = (callbacks or Callbacks()).loop("tct_scaffold", "tct stage 2", len(rounds), self.scaffold_start)
        diverged = run_rounds(path, rounds, evaluate_at, [*first, Report(self.points, self.on_point, path.classifier),
                                                          loop])
        self.scaffold_rounds = rounds[:self.points[-1].round - self.scaffold_start] if diverged else rounds
        return path.model

    def rounds(self, scaffold: bool) -> list[np.ndarray]:
        """The clients of stage 2's rounds, numbered as its rows are: the normalization's, then SCAFFOLD's when it ran
        (``scaffold``; with the closed form's before them on the clock, the last numbered as SCAFFOLD's first), else
        the closed form's."""
        if not scaffold:
            return self.normalization_rounds + self.closed_form_rounds
        return (self.normalization_rounds + self.closed_form_rounds[:self.scaffold_start - self.solvers_start]
                + list(self.scaffold_rounds))


class ScaffoldRounds:
    """Stage 2's SCAFFOLD rounds for :func:`~fedray.engine.round_loop.run_rounds`; ``model`` is the last finite ψ."""

    def __init__(self, run: Stage2Run, normalization: ray.ObjectRef, sampler: Sampler) -> None:
        self.run, self.normalization = run, normalization
        self.local = LocalSolver.of(run.stage.options)
        self.solver = ray.put(self.local)
        self.postprocessing = sampler.uploads(run.postprocessing, run.scaffold_start)
        self.client_weights = run.sizes / run.sizes.sum()
        self.model = torch.zeros(run.width + 1, run.num_classes, dtype=torch.float64)
        self.control = torch.zeros_like(self.model)
        # c goes down with the model when not everyone takes part, and never without control variates
        everyone = sampler.per_round == sampler.num_clients
        self.down = self.model.numel() * (1 if everyone or not self.local.correction else 2)
        self.loss, self.loss_weight = 0.0, 0.0

    def tasks(self) -> ClientTasks:
        """A client's task in a round on the clock: its full-batch steps (the FLOPs / 2 the rows count), ψ (and c)
        down, Δ_k up."""
        floats = self.model.numel()
        return ClientTasks(2.0 * self.local.steps * self.run.sizes * floats, self.down * FLOAT_BYTES,
                           float(floats * FLOAT_BYTES), floats)

    def run_round(self, number: int, clients: np.ndarray) -> bool:
        run, floats = self.run, self.model.numel()
        if not len(clients):  # on the clock, a round whose uploads were all lost: nothing changes
            return True
        clients = np.sort(clients)
        uploads = self.postprocessing.among(clients, number)
        with reporting(run.reported, COLUMNS):
            sums = run.pool.train(self.solver, self.normalization, ray.put(self.model), ray.put(self.control), clients,
                                  self.client_weights[clients], uploads, number)
        received = np.setdiff1d(clients, uploads.dropped(number))
        self.loss, self.loss_weight = self.loss + sums.loss, self.loss_weight + sums.weight
        updated = self.model + sums.delta.to(torch.float64) / sums.weight
        flops = 4.0 * self.local.steps * float(run.sizes[clients].sum()) * floats
        run.accounting.add(clients, run.sizes, len(received) * floats * FLOAT_BYTES,
                           len(clients) * self.down * FLOAT_BYTES, flops, received=received)
        if not bool(torch.isfinite(updated).all()):
            return False
        self.model = updated
        if sums.control_change is not None:
            self.control += sums.control_change.to(torch.float64)
        return True

    def point(self, number: int, diverged: bool = False) -> EvalPoint:
        run = self.run
        accuracy = float("nan") if diverged else run.pool.accuracy(self.normalization, ray.put(self.model))
        loss = None if diverged or not self.loss_weight else self.loss / self.loss_weight
        self.loss, self.loss_weight = 0.0, 0.0
        return run.accounting.point(run.scaffold_start + number, accuracy, time.perf_counter() - run.started,
                                    "tct_scaffold", loss, diverged, run.reported)

    def classifier(self) -> Classifier:
        return stage2_classifier(self.model)


def stage2_classifier(model: torch.Tensor) -> Classifier:
    """A stage-2 model ψ = [W; bᵀ] as the classifier of the standardized (projected) eNTK features, copied."""
    weights, bias = split_model(model)
    return Classifier(weights.clone(), bias.clone())
