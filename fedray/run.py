"""One closed-form run from a configuration: federation → shards → rounds → results on disk."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import ray
from ray.util.placement_group import PlacementGroup

from fedray.config import RunConfig
from fedray.data.federation import Federation
from fedray.data.registry import load_federation
from fedray.evaluation import Evaluator
from fedray.methods import METHODS, ClosedFormMethod
from fedray.results import EvalPoint, config_columns, write_run
from fedray.runtime import sampling
from fedray.runtime.shards import ShardPool
from fedray.runtime.simulation import RunOutcome, run_closed_form


def init_ray(address: str | None = None) -> None:
    """Join ``address`` (or $RAY_ADDRESS); with neither, start an embedded local Ray."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    options = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address:
        ray.init(address=address, **options)
    else:
        ray.init(include_dashboard=False, **options)


def build_method(config: RunConfig, federation: Federation) -> ClosedFormMethod:
    dim, classes = federation.dim, federation.num_classes
    common = {"lam": config.lam, "bias": config.bias}
    options = {
        "fedncm": {},
        "fed3r": common,
        "ffc": common,
        "fed3r-rf": {**common, "rf_dim": config.rf_dim, "rf_sigma": config.rf_sigma or math.sqrt(dim), "seed": config.seed},
        "fedcof": {"gamma": config.gamma, "means_per_class": config.means_per_class, "seed": config.seed},
        "fedcof-oracle": {"gamma": config.gamma, "seed": config.seed},
    }[config.method]
    return METHODS[config.method](dim, classes, **options)


def simulate(
    config: RunConfig,
    method: ClosedFormMethod,
    pool: ShardPool,
    evaluator: Evaluator,
    on_point: Callable[[EvalPoint], None] | None = None,
) -> tuple[RunConfig, list[dict], RunOutcome]:
    """Run ``method`` on an already started shard pool.

    Returns the configuration with every default resolved (κ unless a rate was
    given, shard count, σ), valid as a ``--config`` file; one metrics row per
    evaluation point (κ always resolved); and the outcome.
    """
    federation = pool.federation
    per_round = config.per_round(federation.num_clients)
    rounds = sampling.schedule(federation.num_clients, per_round, config.sampling == "with", config.seed, config.rounds)
    outcome = run_closed_form(pool, method, rounds, config.eval_every, evaluator, quiet=config.quiet, on_point=on_point)
    resolved = replace(
        config,
        clients_per_round=per_round if config.participation is None else None,
        num_shards=pool.num_shards,
        rf_sigma=getattr(method, "rf_sigma", None),
    )
    columns = {**config_columns(resolved.to_dict()), "clients_per_round": per_round}
    return resolved, [{**columns, **asdict(point)} for point in outcome.points], outcome


def run(
    config: RunConfig,
    address: str | None = None,
    trial_group: PlacementGroup | None = None,
    on_point: Callable[[EvalPoint], None] | None = None,
) -> list[dict]:
    """Load, simulate and write ``config.out``; nothing is written unless the run completes.

    Inside a Tune trial, ``trial_group`` is the trial's placement group (see
    :meth:`ShardPool.start`) and ``on_point`` reports each evaluation point.
    """
    federation = load_federation(config.dataset)
    method = build_method(config, federation)
    sampling.check_per_round(federation.num_clients, config.per_round(federation.num_clients))
    init_ray(address)
    pool = ShardPool.start(federation, config.num_shards, config.cpus_per_shard, trial_group=trial_group)
    try:
        resolved, rows, outcome = simulate(config, method, pool, Evaluator(federation), on_point)
    finally:
        pool.shutdown()
    write_run(Path(config.out), rows, resolved.to_dict(), {**outcome.classifier.arrays(), **method.arrays()})
    return rows
