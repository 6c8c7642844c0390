"""One gradient-method run as a pipeline of stages, written once for features and images (:func:`train_in_stages`).

The stages are the plan's (:mod:`fedray.engine.plan`). The closed-form stage
(``--init fedncm|fed3r|fedcof``) runs the method through the shards until every
client was seen (or ``--init-rounds``); its classifier becomes the softmax head
that training starts from. Then training, a calibration (SphereFed's FFC with
``--head sphere``, or ``--calibrate METHOD``) and the ridge probe
(``--probe-ridge``). The closed-form stages run on an
:data:`Embeddings`: the shards' own features, or the images embedded by the
backbone at that moment. Every stage's rows go to one metrics table (``stage``
column), their traffic and FLOPs accumulate, and training's rounds are
numbered after the closed-form stage's. TCT (:mod:`fedray.engine.tct`) runs
fine-tuning, then its eNTK and stage-2 stages.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, TypeVar

import numpy as np
import torch
from ray.util.placement_group import PlacementGroup

from fedray.engine.config import COLUMNS
from fedray.core.federation import TEST, TRAIN, Federation
from fedray.data.memory import with_features
from fedray.runtime.evaluator import Evaluator
from fedray.runtime.finetune.backend import FineTuneBackend
from fedray.methods.training.backend import Params, TrainingBackend
from fedray.methods.finetune_model import get_mode, model_structure, trained_names
from fedray.engine.checkpoint import RunShape, save_checkpoint
from fedray.methods.training.local import random_head
from fedray.runtime.probing import ProbeBackend
from fedray.runtime.schedules import Schedule
from fedray.engine.training import Accounting, Checkpointing, TrainingState, train
from fedray.methods.base import FLOAT_BYTES, Classifier, ClosedFormMethod
from fedray.methods.checks import check_tensors
from fedray.methods.postprocessor import Postprocessing
from fedray.engine.plan import Calibration, Images, Probe, RunPlan, Shards
from fedray.core.reports import reporting
from fedray.core.results import EvalPoint
from fedray.engine.callbacks import Callbacks
from fedray.engine.round_loop import Listener
from fedray.runtime.shards import ShardPool
from fedray.engine.closed_form import everyone_uploads, run_closed_form
from fedray.engine.calibration import ProjectedCalibration, calibrate
from fedray.data.images.backbones import images_backbone
from fedray.runtime.sphere import SphereBackend, initial_projection

T = TypeVar("T")


@dataclass
class TrainingOutcome:
    points: list[EvalPoint]
    params: Params
    accounting: Accounting
    ridge_probe_accuracy: float | None = None
    arrays: dict[str, np.ndarray] | None = None
    """What classifier.npz holds, when it is not the trained softmax head."""
    rounds: Schedule = field(default_factory=Schedule.of)
    """The clients of each round, numbered as the rows are: round r's are ``rounds[r - 1]`` (the closed-form stage's,
    training's, then SphereFed's calibration round of every client)."""


def closed_form_stage(run: RunPlan, rounds: Sequence[np.ndarray], pool: ShardPool, evaluator: Evaluator,
                      on_point: Listener | None, uploads: Postprocessing, callbacks: Callbacks,
                      backbone_macs: float | None) -> tuple[Params, Accounting, list[EvalPoint]]:
    """Stage 1: the ``--init`` method's classifier over ``rounds`` as the head, with its rows and accounting."""
    federation = pool.federation
    method = run.init.method.build(federation)
    outcome = run_closed_form(pool, method, rounds, run.eval_every, evaluator, on_point=on_point,
                              backbone_macs=backbone_macs, postprocessing=uploads, callbacks=callbacks)
    classifier: Classifier = outcome.classifier
    weight = classifier.weight.to(torch.float32)
    bias = torch.zeros(weight.shape[1]) if classifier.bias is None else classifier.bias.to(torch.float32)
    last = outcome.points[-1]
    seen = np.zeros(federation.num_clients, dtype=bool)
    for clients in outcome.rounds:
        seen[clients] = True
    seen[outcome.dropped] = False  # their statistics never reached the server
    accounting = Accounting(seen, last.samples_seen, last.bytes_up, last.bytes_down, last.flops_client_avg * last.clients_seen,
                            outcome.paper)
    return {"weight": weight, "bias": bias}, accounting, outcome.points


def ridge_probe(pool: ShardPool, probe: Probe, evaluator: Evaluator, uploads: Postprocessing, round_number: int) -> float:
    """Fed3R on the features the head was trained on, from every client (Fed3R Section 5.4's feature-quality probe),
    their uploads in round ``round_number`` through the run's postprocessors."""
    method = probe.method.build(pool.federation)
    statistics = everyone_uploads(pool, method, uploads, round_number)
    return evaluator.accuracy(method, method.solve(statistics))


Embeddings = Callable[[Params, Callable[[ShardPool, Evaluator], T]], T]
"""Where the closed-form stages run: ``embeddings(params, work)`` runs ``work(pool, evaluator)`` on shards holding the
features at ``params``: the pool's own features (linear probing, SphereFed), or the images embedded by the backbone of
``params`` (fine-tuning, :func:`on_embeddings`)."""


def train_in_stages(run: RunPlan, backend: TrainingBackend, embeddings: Embeddings, sizes: np.ndarray,
                    uploads: Postprocessing, on_point: Listener | None = None, saved: TrainingState | None = None,
                    backbone_macs: float | None = None, callbacks: Callbacks | None = None) -> TrainingOutcome:
    """A training run's stages, the same on features and on images: the ``--init`` closed form (unless resuming
    ``saved``), training, a calibration (SphereFed's FFC, ``--calibrate``), the ridge probe (``--probe-ridge``); every
    stage's uploads through the run's one ``uploads`` (sampled as training samples; the calibration and the probe:
    every client once).

    ``backbone_macs``: F_φ where the backend measures it (fine-tuning), else the run's. A researcher's ``callbacks``
    that stop the closed-form stage end the run there: no training.
    """
    callbacks = callbacks or Callbacks()
    backbone_macs = run.backbone_macs if backbone_macs is None else backbone_macs
    init_rounds = run.init_rounds
    if saved is None:
        params, accounting, points = backend.initial_params(run.seed), None, []
        if init_rounds:
            head, accounting, points = embeddings(
                params, lambda pool, evaluator: closed_form_stage(run, init_rounds, pool, evaluator, on_point,
                                                                  replace(uploads, first_round=0), callbacks,
                                                                  backbone_macs))
            params = backend.with_head(params, head)
        model = params if backend.trained_names is None else {name: params[name] for name in backend.trained_names}
        algorithm_state = check_tensors(backend.algorithm, "init_server_state", backend.algorithm.init_server_state(model))
        saved = _fresh_state(params, accounting, points, algorithm_state, len(sizes))
    first_round = max((p.round for p in saved.points if p.stage == "closed_form"), default=0)
    if callbacks.stopping:  # stopped in the closed-form stage: its head is the run's
        outcome = TrainingOutcome(saved.points, saved.params, saved.accounting)
    else:
        outcome = _train(run, backend, saved, sizes, on_point, uploads, backbone_macs, callbacks, first_round)
    outcome.rounds = init_rounds[:first_round] + outcome.rounds
    calibration = run.stage(Calibration)
    if calibration is not None and not outcome.points[-1].diverged:
        classifier, method = embeddings(outcome.params, lambda pool, evaluator: calibration_stage(
            calibration, pool, evaluator, outcome, on_point, uploads, *backend.calibration_map(outcome.params)))
        sphere = {} if run.training.sphere is None else backend.sphere_arrays(outcome.params)
        outcome.arrays = {**classifier.arrays(), **method.arrays(), **sphere}
        outcome.rounds += [np.arange(len(sizes))]
    probe = run.stage(Probe)
    if probe is not None:
        probe_round = outcome.points[-1].round + 1
        with reporting(outcome.points[-1].reported, COLUMNS):  # the probe's numbers go in the last row, with its accuracy
            outcome.ridge_probe_accuracy = embeddings(outcome.params, lambda pool, evaluator: ridge_probe(
                pool, probe, evaluator, uploads, probe_round))
    return outcome


def train_on_features(
    run: RunPlan,
    pool: ShardPool,
    evaluator: Evaluator,
    on_point: Listener | None = None,
    saved: TrainingState | None = None,
    callbacks: Callbacks | None = None,
) -> TrainingOutcome:
    """Linear probing with the plan's training stage on the pool's features, or its ``saved`` state continued;
    SphereFed (``--head sphere``) trains the projection before the fixed classifier, then calibrates with FFC. Every
    upload goes through the run's postprocessing."""
    federation, training = pool.federation, run.training
    uploads = training_uploads(run)
    if training.sphere is not None:
        backend = SphereBackend(pool, training.sgd, run.seed, evaluator, training.algorithm,
                                training.sphere.dim or federation.dim, training.sphere.loss, uploads)
    else:
        backend = ProbeBackend(pool, training.sgd, run.seed, evaluator, training.algorithm, postprocessing=uploads)
    return train_in_stages(run, backend, lambda params, work: work(pool, evaluator), federation.client_sizes,
                           uploads, on_point, saved, callbacks=callbacks)


def calibration_stage(stage: Calibration, pool: ShardPool, evaluator: Evaluator, outcome: TrainingOutcome,
                      on_point: Listener | None, uploads: Postprocessing, weight: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None) -> tuple[Classifier, ClosedFormMethod]:
    """The calibration's closed form on the pool's features, one round with every client: SphereFed's FFC on
    normalize(P x + q) with a trained projection (``weight`` P, ``bias`` q), else the stage's method on the features
    (SphereFed's normalize(x) of the fine-tuned embeddings, ``--calibrate``'s method); a ``calibrated`` row; returns
    the calibrated classifier and the method that maps features for it."""
    start = time.perf_counter()
    reported = dict(outcome.points[-1].reported)
    federation = pool.federation
    if weight is None:
        method = stage.method.build(federation)
    else:
        method = ProjectedCalibration(federation.dim, federation.num_classes, stage.method.values["lam"], weight, bias)
    with reporting(reported, COLUMNS):  # a postprocessor's aggregate of the calibration's uploads may report
        classifier, accuracy = calibrate(pool, evaluator, method, uploads, outcome.points[-1].round + 1)
    everyone = np.arange(federation.num_clients)
    sizes = federation.client_sizes.astype(np.float64)
    outcome.accounting.add(everyone, federation.client_sizes, float(method.upload_floats(federation).sum()) * FLOAT_BYTES, 0.0,
                           float(method.statistics_flops(sizes).sum()))
    last = outcome.points[-1]
    point = outcome.accounting.point(last.round + 1, accuracy, last.wall_s + time.perf_counter() - start, "calibrated",
                                     reported=reported)
    outcome.points.append(point)
    if on_point is not None:
        on_point(point, classifier)
    return classifier, method


def finetune_on_images(
    run: RunPlan,
    federation: Federation,
    on_point: Listener | None = None,
    saved: TrainingState | None = None,
    trial_group: PlacementGroup | None = None,
    callbacks: Callbacks | None = None,
) -> TrainingOutcome:
    """Fine-tuning of a backbone and head on the federation's images, on a trainer pool of its own (in
    ``trial_group``'s bundles inside a Tune trial); every upload through the run's postprocessing."""
    uploads = training_uploads(run)
    backend = start_finetuning(run, federation, uploads, trial_group)
    try:
        return finetune(run, backend, uploads, on_point, saved, callbacks)
    finally:
        backend.shutdown()


def start_finetuning(run: RunPlan, federation: Federation, uploads: Postprocessing,
                     trial_group: PlacementGroup | None = None) -> FineTuneBackend:
    """The run's fine-tuning backend on a trainer pool of its own, or in ``trial_group``'s bundles inside a Tune trial
    (shut down with ``backend.shutdown()``), its clients' uploads through ``uploads``."""
    training = run.training
    images: Images = training.images
    return FineTuneBackend.start(
        federation, images.backbone, images.weights, images.mode, training.sgd, run.seed,
        image_size=images.image_size, num_trainers=images.num_trainers, cpus_per_trainer=images.cpus_per_trainer,
        algorithm=training.algorithm, sphere_loss=None if training.sphere is None else training.sphere.loss,
        postprocessing=uploads,
        trial_group=trial_group,
        state_budget=run.shards.state_memory,
    )


def finetune(
    run: RunPlan,
    backend: FineTuneBackend,
    uploads: Postprocessing,
    on_point: Listener | None = None,
    saved: TrainingState | None = None,
    callbacks: Callbacks | None = None,
) -> TrainingOutcome:
    """Fine-tuning with ``backend`` in :func:`train_in_stages`: SphereFed (``--head sphere``) fine-tunes the backbone
    under the fixed classifier, then calibrates with FFC on the normalized embeddings.

    A closed-form initialization, the calibration and the ridge probe run on
    the images embedded by the backbone at that moment, in shards of their own
    (``--num-shards``, default 1, next to the trainers).
    """
    backbone_macs = backend.flops_per_image / 2 if run.backbone_macs is None else run.backbone_macs
    return train_in_stages(run, backend, partial(on_embeddings, run.shards, backend), backend.pool.federation.client_sizes,
                           uploads, on_point, saved, backbone_macs, callbacks)


def on_embeddings(shards: Shards, backend: FineTuneBackend, params: Params,
                  work: Callable[[ShardPool, Evaluator], T]) -> T:
    """``work`` on shards holding the federation's images embedded by the backbone of ``params``.

    Inside a Tune trial the shards share the trainers' bundles, claiming no CPU:
    trainers and shards take turns (the trainers wait while the shards work).
    """
    train_features, _ = backend.embed(params, TRAIN)
    test_features, _ = backend.embed(params, TEST)
    embedded = with_features(backend.pool.federation, train_features, test_features)
    trial_group = backend.pool.trial_group
    if trial_group is None:
        pool = ShardPool.start(embedded, shards.count or 1, shards.cpus)
    else:
        pool = ShardPool.start(embedded, cpus_per_shard=0, trial_group=trial_group)
    try:
        return work(pool, Evaluator(pool))
    finally:
        pool.shutdown()


def _fresh_state(params: Params, accounting: Accounting | None, points: list[EvalPoint], algorithm_state: Params,
                 num_clients: int) -> TrainingState:
    """The state training starts from: after a closed-form stage (its accounting and rows), or from nothing."""
    accounting = accounting or Accounting(np.zeros(num_clients, dtype=bool))
    return TrainingState(params, {}, algorithm_state, accounting, list(points))


def training_uploads(run: RunPlan) -> Postprocessing:
    """The run's postprocessing as training samples (κ of the K clients a round), its rounds numbered after a
    closed-form ``--init``'s."""
    return run.sampler.uploads(run.postprocessing, len(run.init_rounds))


def checkpoint_shape(run: RunPlan, federation: Federation) -> RunShape:
    """What a checkpoint of this training run must fit (checked before any work): the model it trains (linear
    probing's d × C head, SphereFed's l × d projection, the fine-tuned network's state dict), its training
    algorithm's server state for that model, its K clients and its training rounds."""
    training = run.training
    if training.images is not None:
        model = model_structure(images_backbone(training.images.backbone, federation), federation.num_classes)
        params = model.state_dict()
        trained = {name: params[name] for name in trained_names(model, get_mode(training.images.mode))}
    else:
        if training.sphere is not None:
            params = initial_projection(federation.dim, training.sphere.dim or federation.dim, run.seed)
        else:
            params = random_head(federation.dim, federation.num_classes, run.seed)
        trained = params
    rounds = len(run.training_rounds)
    return RunShape(params, training.algorithm.init_server_state(trained), federation.num_clients, rounds)


def _train(run: RunPlan, backend: TrainingBackend, state: TrainingState, sizes: np.ndarray,
           on_point: Listener | None, uploads: Postprocessing, backbone_macs: float | None, callbacks: Callbacks,
           first_round: int) -> TrainingOutcome:
    """Training from ``state`` after ``first_round`` rounds of a closed-form stage: the schedule, checkpoints to the
    run's folder, the loop; ``backbone_macs``: F_φ."""
    training = run.training
    rounds = run.training_rounds
    checkpointing = Checkpointing(training.checkpoint_every, lambda s: save_checkpoint(run.out, run.identity, s), run.out)
    diverged = train(backend, backend.algorithm, training.server_optimizer, state, rounds, sizes, run.eval_every,
                     first_round, checkpointing, on_point, backbone_macs, uploads,
                     callbacks.loop("train", training.name, len(rounds), first_round))
    stopped = diverged or callbacks.stopping
    ran = state.points[-1].round - first_round if stopped else len(rounds)  # a stopped run ends at its last row
    return TrainingOutcome(state.points, state.params, state.accounting, rounds=rounds[:ran])
