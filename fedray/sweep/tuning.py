"""``fedray sweep``: a Ray Tune grid (and random draws) over ``fedray run`` options.

Each trial is one simulation with shard actors of its own, all inside the
trial's placement group (driver bundle + one bundle per shard), so trials
never oversubscribe the cluster and Tune runs as many at once as the
resources allow. Trials report every evaluation point (metric ``accuracy``).
The sweep ends by combining every trial's ``metrics.parquet`` into
``OUT/NAME/results.parquet``; a resumed sweep rebuilds it from all trials.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import polars as pl
from ray import tune
from ray.util import get_current_placement_group

from fedray.errors import FedrayError
from fedray.results import METRICS, write_atomically
from fedray.engine import init_ray, run
from fedray.sweep.spec import OPTIONS_PREFIX, SweepSpec
from fedray.sweep.trials import check_trials, fixed_params, trial_config

RESULTS = "results.parquet"
SAMPLERS = {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}


def run_trial(params: dict) -> None:
    """One trial: a ``fedray run`` with ``params``, its shards in this trial's placement group."""
    config = trial_config(params, out=tune.get_context().get_trial_dir())
    run(config, trial_group=get_current_placement_group(), on_point=lambda point: tune.report(asdict(point)))


def param_space(spec: SweepSpec) -> dict:
    space: dict = fixed_params(spec)
    space.update({key: tune.grid_search(choices) for key, choices in spec.grid.items()})
    for key, distribution in spec.random.items():
        kind, arguments = next(iter(distribution.items()))
        space[key] = tune.choice(arguments) if kind == "choice" else SAMPLERS[kind](*arguments)
    return space


def sweep(
    spec: SweepSpec, out: str | Path, resume: bool = False, address: str | None = None, quiet: bool = False
) -> pl.DataFrame:
    """Run (or resume) the sweep; returns and writes the combined results table.

    Every trial's options are checked before Tune starts (:func:`check_trials`).
    """
    check_trials(spec)
    folder = Path(out).resolve() / spec.name
    trainable = tune.with_resources(run_trial, tune.PlacementGroupFactory(spec.bundles, strategy="PACK"))
    if resume and not tune.Tuner.can_restore(str(folder)):
        raise FedrayError(f"{folder}: no sweep to resume")
    if not resume and folder.exists():
        raise FedrayError(f"{folder}: a sweep named {spec.name!r} is already there; use --resume or another --out")
    init_ray(address)
    if resume:
        tuner = tune.Tuner.restore(str(folder), trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=param_space(spec),
            tune_config=tune.TuneConfig(metric="accuracy", mode="max", num_samples=spec.num_samples),
            run_config=tune.RunConfig(name=spec.name, storage_path=str(folder.parent), verbose=0 if quiet else 1),
        )
    grid = tuner.fit()
    failed = [result for result in grid if result.error is not None]
    table = combine(spec, grid)
    write_atomically(folder / RESULTS, table.write_parquet)
    if failed:
        raise FedrayError(f"{len(failed)} of {len(grid)} trials failed (first: {str(failed[0].error).splitlines()[0]}); "
                          f"finished trials are in {folder / RESULTS}; fix and rerun with --resume")
    return table


def combine(spec: SweepSpec, grid: tune.ResultGrid) -> pl.DataFrame:
    """All finished trials' metrics rows, with the trial id and every swept parameter as columns, in trial order."""
    frames = []
    for result in grid:
        metrics = Path(result.path) / METRICS
        if result.error is None and metrics.is_file():
            frame = pl.read_parquet(metrics)
            trial_id = result.metrics.get("trial_id", Path(result.path).name)
            swept = {key: result.config[key] for key in spec.swept if key not in frame.columns and not key.startswith(OPTIONS_PREFIX)}
            frames.append(frame.with_columns(pl.lit(trial_id).alias("trial_id"), *(pl.lit(v).alias(k) for k, v in swept.items())))
    if not frames:
        return pl.DataFrame({"trial_id": []}, schema={"trial_id": pl.String})
    table = pl.concat(frames, how="diagonal_relaxed").with_columns(pl.lit(spec.name).alias("sweep"))
    return table.sort(["trial_id", "round"])
