"""One run from a configuration: federation → shards → rounds (closed-form or training) → results on disk."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from ray.util.placement_group import PlacementGroup

from fedray.engine.config import RunConfig
from fedray.core.federation import Federation
from fedray.data.registry import load_federation, recorded_backbone_macs
from fedray.runtime.evaluator import Evaluator
from fedray.engine.checkpoint import CHECKPOINT, checkpoint_stamp, load_checkpoint, remove_checkpoint
from fedray.engine.training import TrainingState
from fedray.methods.base import ClosedFormMethod
from fedray.engine.pipeline import RunPlan, StageContext, run_stages
from fedray.engine.plan import plan, postprocessing, stages
from fedray.methods.postprocessor import Postprocessing
from fedray.engine.callbacks import Callbacks
from fedray.core.results import RUN_FILES, EvalPoint, remove_stale_temporaries, write_run
from fedray.engine.round_loop import Listener
from fedray.runtime import provenance, sampling
from fedray.runtime.ray_start import RayStart
from fedray.runtime.shards import ShardPool
from fedray.engine.closed_form import RunOutcome, run_closed_form
from fedray.engine.run_start import starting


@dataclass
class CompletedRun:
    """What a completed run wrote and which clients its rounds sampled."""

    rows: list[dict]
    """metrics.parquet's rows."""
    arrays: dict[str, np.ndarray]
    """classifier.npz's arrays: ``W`` and ``bias`` (when there is one), and what else the classifier needs."""
    rounds: Sequence[np.ndarray]
    """The clients of each round, numbered as the rows are: round r's are ``rounds[r - 1]`` (drawn as they are read)."""


def simulate(
    config: RunConfig,
    method: ClosedFormMethod,
    pool: ShardPool,
    evaluator: Evaluator,
    on_point: Listener | None = None,
    postprocessing: Postprocessing = Postprocessing(),
    callbacks: Callbacks | None = None,
) -> tuple[RunConfig, list[dict], RunOutcome]:
    """Run a closed-form ``method`` on an already started shard pool, every upload through ``postprocessing``.

    Returns the configuration with every default resolved (κ unless a rate was
    given, shard count, σ), valid as a ``--config`` file; one metrics row per
    evaluation point (κ always resolved); and the outcome.
    """
    config = config.resolved()
    federation = pool.federation
    per_round = config.per_round(federation.num_clients)
    rounds = sampling.schedule(federation.num_clients, per_round, config.sampling == "with", config.seed, config.rounds)
    postprocessing = postprocessing.sampled(federation.num_clients, per_round, config.sampling == "with")
    if callbacks is None:  # the progress bar unless quiet
        callbacks = Callbacks.of_run(None, config.quiet)
        on_point = callbacks.hearing(on_point)
    outcome = run_closed_form(pool, method, rounds, config.eval_every, evaluator, on_point=on_point,
                              backbone_macs=config.backbone_macs, postprocessing=postprocessing, callbacks=callbacks)
    resolved = _resolved(config, federation.num_clients, num_shards=pool.num_shards, **method.recorded())
    return resolved, metrics_rows(resolved, per_round, outcome.points, **stopped_early(callbacks)), outcome


def _resolved(config: RunConfig, num_clients: int, **values: object) -> RunConfig:
    """``config`` with κ resolved (unless a rate was given) and ``values`` recorded (a run option's, a plugin's)."""
    per_round = config.per_round(num_clients)
    return replace(config.recording(values), clients_per_round=per_round if config.participation is None else None)


def metrics_rows(resolved: RunConfig, per_round: int, points: list[EvalPoint], stopped_early: bool = False,
                 **last: object) -> list[dict]:
    """One row per point: the configuration's columns (those that apply to the run), then the point's; ``last`` adds
    columns to the final row (null on the others). ``stopped_early``: a researcher's callback stopped the run at the
    last row, whose ``stopped_early`` column is true (false on the rows before it; no such column otherwise)."""
    columns = {**resolved.metrics_columns(), "clients_per_round": per_round}
    reported = {name: None for point in points for name in point.added_names()}  # null on the rows without it
    stop = {"stopped_early": False} if stopped_early else {}
    rows = [{**columns, **reported, **point.columns(), **{key: None for key in last}, **stop} for point in points]
    rows[-1].update(last, **{name: True for name in stop})
    return rows


def stopped_early(callbacks: Callbacks | None) -> dict[str, bool]:
    """:func:`metrics_rows`' ``stopped_early``, true where a researcher's callback stopped the run."""
    return {"stopped_early": True} if callbacks is not None and callbacks.stopping else {}


def _saved_state(run: RunPlan, federation: Federation) -> TrainingState:
    """The checkpoint in the run's folder, checked against this run (its model, clients and rounds) before any work."""
    return load_checkpoint(run.out, run.identity, run.checkpoint_shape(federation))


def run(
    config: RunConfig,
    address: str | None = None,
    trial_group: PlacementGroup | None = None,
    on_point: Listener | None = None,
    resume: bool = False,
    federation: Federation | None = None,
    verbose: bool = False,
    callbacks: Callbacks | None = None,
    command: str | None = None,
    ray_start: RayStart | None = None,
) -> CompletedRun:
    """Load, simulate and write ``config.out``; nothing but checkpoints is written unless the run completes.

    Inside a Tune trial, ``trial_group`` is the trial's placement group (see
    :meth:`ShardPool.start`). ``on_point`` hears each evaluation point with
    the classifier evaluated there (a closed form's solve, a training run's head).
    ``resume`` continues a training run from its checkpoint in ``config.out``.
    ``verbose`` shows what Ray's workers print (see :func:`~fedray.runtime.session.init_ray`).
    ``federation``, when given, is the data (``config.dataset`` names it),
    e.g. one built in Python: it is not loaded from the spec.
    ``command`` (the command line, or the API call's name) is recorded in run.json with what else made the run
    (:mod:`fedray.runtime.provenance`).
    A diverged training run is written too; its last row says so. Every input,
    the output folder included, is checked before the work starts; the run
    holds that folder to its end (a second run into it is refused) and removes
    the checkpoint at the end only if it resumed from it or wrote it. Ray starts in the background while the data is
    read (see :func:`~fedray.engine.run_start.starting`); ``ray_start``: that start, begun by a caller inside
    :func:`~fedray.engine.run_start.starting` for ``config`` (``fedray run``, before it imports torch).
    """
    if ray_start is not None:
        return run_started(config.validate().resolved(), ray_start, trial_group, on_point, resume, federation,
                           callbacks, command)
    with starting(config, address, verbose) as (config, ray_start):
        return run_started(config, ray_start, trial_group, on_point, resume, federation, callbacks, command)


def run_started(config: RunConfig, ray_start: RayStart, trial_group: PlacementGroup | None = None,
                on_point: Listener | None = None, resume: bool = False, federation: Federation | None = None,
                callbacks: Callbacks | None = None, command: str | None = None) -> CompletedRun:
    """:func:`run` inside :func:`~fedray.engine.run_start.starting`: ``config`` as it yields it (validated and
    resolved, its output folder held), Ray starting as ``ray_start``; for ``fedray run``, which enters that block
    before it imports torch (this module's imports)."""
    started = provenance.utc_now()
    out = Path(config.out)
    built = postprocessing(config)  # the run's one postprocessing, every stage's: the plugins' checks, before any work
    planned = stages(config)  # the training algorithm and server optimizer, built with their options before the data
    federation = load_federation(config.dataset) if federation is None else federation
    federation.require_test_rows()
    if config.backbone_macs is None:
        config = replace(config, backbone_macs=recorded_backbone_macs(config.dataset))
    run = plan(config, federation, planned, built)
    per_round = run.sampler.per_round
    sampling.check_per_round(federation.num_clients, per_round, default=config.clients_per_round is None and config.participation is None)
    for stage in run.stages:
        stage.check(run, federation)
    run.postprocessing.start(run.stage_uploads())  # a postprocessor's refusal, in one line, before any work
    config = config.recording(run.postprocessing.recorded())  # what config.yaml and the rows say: a calibrated σ
    saved = _saved_state(run, federation) if resume else None
    found_checkpoint = checkpoint_stamp(out)
    remove_stale_temporaries(out, (*RUN_FILES, CHECKPOINT))
    callbacks = Callbacks.of_run(callbacks, config.quiet)
    callbacks.start(config.to_dict())
    on_point = callbacks.hearing(on_point)
    ray_start.join()
    context = StageContext(run, federation, callbacks, on_point, saved, trial_group)
    try:
        result = run_stages(run.stages, context)
    finally:
        context.close()
    resolved = _resolved(config, federation.num_clients, **result.resolved)
    rows = metrics_rows(resolved, per_round, result.points, **result.last_columns, **stopped_early(callbacks))
    made = provenance.record(resolved.num_shards, resolved.cpus_per_shard, command, started)
    write_run(out, rows, resolved.to_dict(), result.arrays, result.model,
              None if run.clock is None else run.clock.table(), made)
    if resume or checkpoint_stamp(out) != found_checkpoint:
        remove_checkpoint(out)
    callbacks.end(rows)
    return CompletedRun(rows, result.arrays, result.rounds)
