"""The training stage, written once for features and images: ``--init``'s closed form, then the rounds of training.

The closed-form ``--init`` (fedncm|fed3r|fedcof) runs the method through the
shards until every client was seen (or ``--init-rounds``); its classifier
becomes the softmax head that training starts from, and training's rounds are
numbered after its. Training runs on a linear head, SphereFed's projection
(on the pool's features) or a network fine-tuned on images
(:mod:`fedray.engine.finetuning`, loaded only then: torchvision). Its result
hands the stages after it (a calibration, the ridge probe, TCT's stage 2) the
trained parameters, the backend that trained them and where the features at
those parameters are. Every stage's rows go to one metrics table (``stage``
column), and their traffic and FLOPs accumulate.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

import numpy as np

from fedray.clock.costs import TaskCost
from fedray.core.federation import Federation
from fedray.core.results import EvalPoint
from fedray.engine.checkpoint import RunShape, save_checkpoint
from fedray.engine.closed_form import ClosedForm
from fedray.engine.asynchronous import AsyncUpdates
from fedray.engine.clocked import ClockColumns, ClockedTraining, TrainingTasks
from fedray.engine.parts import Images, training_uploads
from fedray.engine.pipeline import Embeddings, RunPlan, Stage, StageContext, StageResult
from fedray.engine.training import Accounting, Checkpointing, TrainingState, train
from fedray.methods.algorithm import FederatedAlgorithm
from fedray.methods.base import Classifier
from fedray.methods.checks import check_tensors
from fedray.methods.postprocessor import Postprocessing, StageUploads
from fedray.methods.training.backend import TrainingBackend
from fedray.methods.sphere import SphereHead
from fedray.methods.training.local import LocalSGD, classifier_head, random_head
from fedray.methods.training.server import ServerOptimizer
from fedray.runtime import sampling
from fedray.runtime.footprint import Footprint, largest_clients, training_footprint
from fedray.runtime.evaluator import Evaluator
from fedray.runtime.probing import ProbeBackend
from fedray.runtime.schedules import Schedule
from fedray.runtime.shards import ShardPool
from fedray.runtime.sphere import SphereBackend, initial_projection

ROUNDS_DRAWN_FOR_ESTIMATE = 10_000_000
"""The most client draws :meth:`Training.largest_round` makes before a run (a second time: the run draws them too)."""


@dataclass(frozen=True, kw_only=True)
class Training(Stage):
    """The training stage: the algorithm, its clients' local SGD and the server optimizer, for ``rounds`` rounds (None:
    until every client was seen); on a linear head, SphereFed's projection (``sphere``) or images (``images``); from
    the head ``init``'s closed form solves (``--init``), else from a random one."""

    algorithm: FederatedAlgorithm
    server_optimizer: ServerOptimizer
    sgd: LocalSGD
    rounds: int | None
    checkpoint_every: int | None
    sphere: SphereHead | None = None
    images: Images | None = None
    init: ClosedForm | None = None
    method: str = ""
    """The ``--method`` name it trains as (an alias such as fedadam names FedAvg with its server optimizer)."""

    @property
    def name(self) -> str:
        """What it trains with, for its progress bar and memory estimate: ``--method``'s name (a plugin's class
        name)."""
        return self.method or self.algorithm.name or type(self.algorithm).__name__

    def init_rounds(self, run: RunPlan) -> Schedule:
        """The clients of the ``--init`` closed form's rounds (none without one): training's come after them."""
        return Schedule.of() if self.init is None else run.rounds(self.init.rounds)

    def schedule(self, run: RunPlan) -> Schedule:
        """The clients of each training round: ``--rounds`` of them, else until every client was seen."""
        return run.rounds(self.rounds, past_coverage=True)

    def postprocessing(self, run: RunPlan) -> Postprocessing:
        """The run's postprocessing as training samples (κ of the K clients a round), its rounds numbered after
        ``--init``'s."""
        return run.sampler.uploads(run.postprocessing, len(self.init_rounds(run)))

    def check(self, run: RunPlan, federation: Federation) -> None:
        """``--rounds``; on the clock, ``--init``'s rounds on features planned (on images its features and F_φ are
        known only once the network is loaded)."""
        if self.rounds is not None:  # training runs exactly --rounds rounds
            sampling.check_rounds(self.rounds)
        if run.clock is not None and self.init is not None and self.images is None:
            self.init.plan_clock(run, federation)

    def uploads(self, run: RunPlan) -> tuple[StageUploads, ...]:
        init = () if self.init is None else self.init.uploads(run, "init")
        return (*init, training_uploads("training", run.sampler.drawn, len(self.schedule(run))))

    def footprints(self, run: RunPlan, federation: Federation) -> tuple[Footprint, ...] | None:
        """``--init``'s and training's; none on images (not estimated)."""
        if self.images is not None:
            return None
        kept = federation.num_clients if self.rounds is None else \
            min(federation.num_clients, self.rounds * run.sampler.per_round)
        sphere_dim = None if self.sphere is None else self.sphere.width(federation.dim)
        training = training_footprint(self.name, federation, self.algorithm, sphere_dim, kept,
                                      self.largest_round(run, federation), run.shards.state_budget)
        init = () if self.init is None else self.init.footprints(run, federation, f"{self.init.method.name} (--init)")
        return (*init, training)

    def largest_round(self, run: RunPlan, federation: Federation) -> int:
        """Samples of the largest training round, each drawn here as the run will draw it (O(κ) memory); the κ
        largest clients' where that would take more than :data:`ROUNDS_DRAWN_FOR_ESTIMATE` draws (or ``--rounds`` is
        beyond what a sequence counts: refused later, in one line). Among a million clients the hundred largest hold
        some 250,000 samples, a drawn hundred about 1,300: that bound would refuse a run that fits."""
        per_round = run.sampler.per_round
        count = len(self.schedule(run)) if self.rounds is None else self.rounds
        if count * per_round > ROUNDS_DRAWN_FOR_ESTIMATE:
            return largest_clients(federation, per_round)
        sizes = federation.client_sizes
        return max((int(sizes[clients].sum()) for clients in self.schedule(run)), default=0)

    def checkpoint_shape(self, run: RunPlan, federation: Federation) -> RunShape:
        """What a checkpoint of this training must fit (checked before any work): the model it trains (linear
        probing's d × C head, SphereFed's l × d projection, the fine-tuned network's state dict), its training
        algorithm's server state for that model, its K clients and its training rounds."""
        if self.images is not None:
            from fedray.engine.finetuning import network_shape  # torchvision loads only for runs on images

            params, trained = network_shape(self.images, federation)
        else:
            if self.sphere is not None:
                params = initial_projection(federation.dim, self.sphere.width(federation.dim), run.seed)
            else:
                params = random_head(federation.dim, federation.num_classes, run.seed)
            trained = params
        rounds = len(self.schedule(run))
        return RunShape(params, self.algorithm.init_server_state(trained), federation.num_clients, rounds)

    def run(self, context: StageContext, previous: StageResult) -> StageResult:
        """``--init``'s closed form (unless resuming the checkpoint), then training; a researcher's callbacks that stop
        the closed form end training there. The first stage of a training run: it starts from ``--init``'s head, a
        random one or the checkpoint, not from ``previous``."""
        postprocessing = self.postprocessing(context.run)
        if self.images is not None:
            from fedray.engine.finetuning import open_network  # torchvision loads only for runs on images

            backend, embeddings, backbone_macs = open_network(self.images, context, sgd=self.sgd,
                                                              algorithm=self.algorithm, sphere=self.sphere,
                                                              postprocessing=postprocessing,
                                                              client_losses=_measures_losses(context.run))
            resolved: dict[str, object] = {}
        else:
            backend, embeddings = self._open_head(context, postprocessing), _on_pool(context)
            backbone_macs, resolved = context.run.backbone_macs, {"num_shards": context.pool.num_shards}
        tasks = None if context.run.clock is None else self._tasks(context.run, backend, context.federation)
        result = self._run(context, backend, embeddings, backbone_macs, postprocessing, tasks)
        params = result.params
        # SphereFed's projection (P, q) on features, as classifier.npz holds it when no calibration follows (a
        # diverged training); else the trained head
        head = Classifier(*backend.calibration_map(params)) if self.sphere is not None and self.images is None \
            else backend.head(params)
        result.arrays, result.resolved = head.arrays(), resolved
        result.model = params if self.images is not None else None
        result.backend, result.embeddings = backend, embeddings
        return result

    def _open_head(self, context: StageContext, postprocessing: Postprocessing) -> TrainingBackend:
        """Linear probing (SphereFed: its projection) on the pool's features, measuring the clients' losses where the
        run's clock reads them."""
        run = context.run
        losses = _measures_losses(run)
        if self.sphere is not None:
            return SphereBackend(context.pool, self.sgd, run.seed, context.evaluator, self.algorithm, self.sphere,
                                 postprocessing, losses)
        return ProbeBackend(context.pool, self.sgd, run.seed, context.evaluator, self.algorithm,
                            postprocessing=postprocessing, client_losses=losses)

    def _tasks(self, run: RunPlan, backend: TrainingBackend, federation: Federation) -> TrainingTasks:
        """A training client's task on the clock (the sizes of the model, broadcast and upload, from the initial
        parameters), refusing in one line, before any round, a deadline no device meets."""
        params = backend.initial_params(run.seed)
        names = backend.trained_names
        model = params if names is None else {name: params[name] for name in names}
        tasks = TrainingTasks.of(backend, backend.algorithm, model, backend.algorithm.init_server_state(model),
                                 federation.client_sizes)
        run.clock.check(TaskCost(tasks.macs, tasks.down_bytes, tasks.up_bytes))
        return tasks

    def _clocked(self, run: RunPlan, tasks: TrainingTasks, first_round: int, postprocessing: Postprocessing,
                 state: TrainingState, sizes: np.ndarray) -> _Clocked:
        """Training's rounds on the run's clock, which they advance, their uploads through ``postprocessing``:
        synchronous rounds clocked one at a time as training reaches them (their selector may read the losses of the
        rounds before, kept in ``state``), an asynchronous scheduler's server steps all at once."""
        clock, schedule = run.clock, self.schedule(run)
        if clock.asynchronous.asynchronous:
            start_s, scheduler = clock.now, clock.asynchronous
            plan, records = clock.asynchronous_steps(len(schedule), list(schedule), tasks.costs, first_round, "train")
            updates = AsyncUpdates(plan.trained_from(), scheduler.staleness_function(), scheduler.divides_plainly,
                                   scheduler.mixing_rate)
            evaluate_at = clock.evaluate_at([record.end_s for record in records], start_s)
            return _Clocked([record.clients for record in records], None if evaluate_at is None else {0, *evaluate_at},
                            ClockColumns(clock), None, [len(record.selected) for record in records], updates)
        rounds = ClockedTraining(clock, schedule, tasks, first_round, "train", sizes,
                                 lambda number: state.client_losses.get(number), postprocessing)
        return _Clocked(rounds, None if clock.every_s is None else rounds.every_s(clock.every_s), ClockColumns(clock),
                        rounds.per_round(lambda record: record.steps) if clock.partial else None,
                        rounds.per_round(lambda record: len(record.selected)))

    def _run(self, context: StageContext, backend: TrainingBackend, embeddings: Embeddings,
             backbone_macs: float | None, postprocessing: Postprocessing,
             tasks: TrainingTasks | None = None) -> StageResult:
        """Training from ``--init``'s head (or the checkpoint), its uploads through ``postprocessing``;
        ``backbone_macs``: F_φ; ``tasks``: a client's task on the run's clock (None: no clock)."""
        run, callbacks, state = context.run, context.callbacks, context.saved
        sizes = context.federation.client_sizes
        init_rounds = self.init_rounds(run)
        if state is None:
            params, accounting, points = backend.initial_params(run.seed), None, []
            if init_rounds:
                init = self.init
                head, accounting, points, init_rounds = embeddings(params, lambda pool, evaluator: _initial_head(
                    init, context, pool, evaluator, backbone_macs))
                params = backend.with_head(params, classifier_head(head))
            model = params if backend.trained_names is None else {name: params[name] for name in backend.trained_names}
            algorithm_state = check_tensors(backend.algorithm, "init_server_state",
                                            backend.algorithm.init_server_state(model))
            state = TrainingState(params, {}, algorithm_state,
                                  accounting or Accounting(np.zeros(len(sizes), dtype=bool)), list(points))
        first_round = max((p.round for p in state.points if p.stage == "closed_form"), default=0)
        if callbacks.stopping:  # stopped in the closed-form stage: its head is the run's
            return StageResult(state.points, state.accounting, state.params, init_rounds[:first_round])
        rounds: Sequence[np.ndarray] = self.schedule(run)
        clocked = _Clocked()
        if run.clock is not None:
            if context.saved is not None and init_rounds:  # the closed form ran before the checkpoint: its time too
                init_rounds = self.init.clocked(run, context.federation, self.init.build(context.federation),
                                                backbone_macs).rounds
            clocked = self._clocked(run, tasks, first_round, postprocessing, state, sizes)
            rounds = clocked.rounds
        every = None if clocked.asynchronous is not None else self.checkpoint_every  # see fedray.engine.asynchronous
        checkpointing = Checkpointing(every, lambda s: save_checkpoint(run.out, run.identity, s), run.out)
        diverged = train(backend, backend.algorithm, self.server_optimizer, state, rounds, sizes, run.eval_every,
                         first_round, checkpointing, context.on_point, backbone_macs, postprocessing,
                         callbacks.loop("train", self.name, len(rounds), first_round), clocked.evaluate_at,
                         clocked.columns, clocked.steps, clocked.downloads, clocked.asynchronous)
        stopped = diverged or callbacks.stopping
        ran = state.points[-1].round - first_round if stopped else len(rounds)  # a stopped run ends at its last row
        return StageResult(state.points, state.accounting, state.params, init_rounds[:first_round] + rounds[:ran])


@dataclass(frozen=True)
class _Clocked:
    """Training's rounds on the clock: who trains in each (``rounds``), which rounds are evaluated (None: every
    ``--eval-every``), the rows' clock columns, each round's local steps (None: all of them), how many clients
    download the model in each (every selected one; None: the clients that train) and, under an asynchronous
    scheduler, the updates of its server steps."""

    rounds: Sequence[np.ndarray] = ()
    evaluate_at: Container[int] | None = None
    columns: ClockColumns | None = None
    steps: Sequence[np.ndarray | None] | None = None
    downloads: Sequence[int] | None = None
    asynchronous: AsyncUpdates | None = None


def _measures_losses(run: RunPlan) -> bool:
    """Whether training measures its clients' losses: the run's clock reads them."""
    return run.clock is not None and run.clock.measures_losses


def _on_pool(context: StageContext) -> Embeddings:
    """The closed-form stages on the pool's own features, whatever the parameters (a linear head is not a feature
    map; SphereFed's calibration maps them itself)."""
    return lambda params, work: work(context.pool, context.evaluator)


def _initial_head(init: ClosedForm, context: StageContext, pool: ShardPool, evaluator: Evaluator,
                  backbone_macs: float | None) -> tuple[Classifier, Accounting, list[EvalPoint], Schedule]:
    """``--init``'s classifier on ``pool``'s features, with its rows, accounting and rounds (on the clock, the clients
    each of its rounds heard from, its rounds after the schedule's too)."""
    federation = pool.federation
    outcome = init.solve(context, init.method.build(federation), pool, evaluator, backbone_macs)
    last = outcome.points[-1]
    seen = np.zeros(federation.num_clients, dtype=bool)
    for clients in outcome.rounds:
        seen[clients] = True
    seen[outcome.dropped] = False  # their statistics never reached the server
    accounting = Accounting(seen, last.samples_seen, last.bytes_up, last.bytes_down,
                            last.flops_client_avg * last.clients_seen, outcome.paper)
    return outcome.classifier, accounting, outcome.points, outcome.rounds
