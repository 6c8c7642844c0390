"""``fedray sweep``: a Ray Tune grid (and random draws) over ``fedray run`` options.

Each trial is one simulation with shard actors of its own, all inside the
trial's placement group (driver bundle + one bundle per shard), so trials
never oversubscribe the cluster and Tune runs as many at once as the
resources allow. Trials report every evaluation point (metric ``accuracy``).
The sweep ends by combining every trial's ``metrics.parquet`` into
``OUT/NAME/results.parquet``; a resumed sweep rebuilds it from all trials.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

import polars as pl
from ray import tune
from ray.util import get_current_placement_group

from fedray.core.errors import FedrayError
from fedray.core.results import ENVIRONMENT_PREFIX, METRICS, RUN_JSON, remove_stale_temporaries, write_atomically
from fedray.engine.callbacks import Callback, Callbacks
from fedray.engine.run_config import run
from fedray.engine.checkpoint import CHECKPOINT
from fedray.core.plugins import plugin_failure
from fedray.runtime import parked
from fedray.runtime.cluster import check_bundles_fit
from fedray.runtime.messages import without_messages
from fedray.runtime.provenance import FIELDS
from fedray.runtime.session import init_ray
from fedray.app.sweeps.spec import DATASET_PREFIX, SweepSpec
from fedray.app.sweeps.trials import check_trials, fixed_params, trial_config
from fedray.core.writable import check_folder

RESULTS = "results.parquet"
ANSI_CODES = re.compile(r"\x1b\[[0-9;]*m")
SAMPLERS = {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}
COLUMN_TYPES = {str: pl.String, bool: pl.Boolean, int: pl.Int64, float: pl.Float64}


def run_trial(params: dict, folder: str, callbacks: Sequence[Callback] = (), command: str | None = None) -> None:
    """One trial: a ``fedray run`` with ``params``, its shards in this trial's placement group, continued from its
    checkpoint when an interrupted sweep is resumed.

    The run writes to the trial's folder in the sweep's ``folder``, where the
    results are read, not to the local staging copy Tune gives as the trial's
    directory (``get_trial_dir()``) and copies into it now and then: a copy
    made while a checkpoint was there kept that checkpoint beside the finished
    trial's results (the run removes its own, not Tune's copy), and a resumed
    trial, staged anew, never found its checkpoint. Each trial runs its own copy of a researcher's ``callbacks``;
    its run.json records the sweep's ``command``.
    """
    out = Path(folder) / Path(tune.get_context().get_trial_dir()).name
    config = trial_config(params, out=str(out))
    run(config, trial_group=get_current_placement_group(), on_point=lambda point, _: tune.report(point.columns()),
        resume=(out / CHECKPOINT).is_file(), callbacks=Callbacks(tuple(copy.deepcopy(callbacks))), command=command)


def param_space(spec: SweepSpec) -> dict:
    space: dict = fixed_params(spec)
    space.update({key: tune.grid_search(choices) for key, choices in spec.grid.items()})
    for key, distribution in spec.random.items():
        kind, arguments = next(iter(distribution.items()))
        space[key] = tune.choice(arguments) if kind == "choice" else SAMPLERS[kind](*arguments)
    return space


TUNE_RUN_LOGGER = "ray.tune.tune"
TUNE_SAYS_ON_FAILURES = ("Trials did not complete", "Stop signal received", "Experiment has been interrupted")
"""What Tune logs after failed trials (a list of them) and on Ctrl-C (that it stops; how to resume with
``Tuner.restore``, where fedray's line says ``--resume``)."""


@contextmanager
def _without_tune_s_failure_messages() -> Iterator[None]:
    """Tune's own words on failed trials and on Ctrl-C, even with ``--quiet``: an ERROR log with the whole traceback
    per failed trial (``TUNE_PRINT_ALL_TRIAL_ERRORS``, read when ``fit`` starts), the list of failed trials, the
    resume hint. fedray says each in one line: a line per failed trial, the sweep's error, how to continue."""
    with _environment("TUNE_PRINT_ALL_TRIAL_ERRORS", "0"), without_messages(TUNE_RUN_LOGGER, *TUNE_SAYS_ON_FAILURES):
        yield


@contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _trial_name(spec: SweepSpec, result: tune.Result) -> str:
    """The swept values the trial ran with, else (nothing swept) its folder's name."""
    values = [f"{key}={result.config[key]}" for key in spec.swept if key in result.config]
    return ", ".join(values) if values else Path(result.path).name


def sweep(
    spec: SweepSpec, out: str | Path, resume: bool = False, address: str | None = None, quiet: bool = False,
    callbacks: Sequence[Callback] = (), command: str | None = None,
) -> pl.DataFrame:
    """Run (or resume) the sweep; returns and writes the combined results table. Every trial runs a copy of
    ``callbacks`` (a researcher's :class:`~fedray.Callback` instances): the columns they add are the table's too.
    ``command`` (the command line, or the API call's name) is what each trial's run.json records as its command.

    Every trial's options are checked before Tune starts (:func:`check_trials`).
    A failed trial is named in one line (stderr); when every trial fails,
    nothing is written and the error says so. Ctrl-C stops the trials and
    raises KeyboardInterrupt once Tune has saved the sweep's state (``resume``
    continues it, each unfinished trial from its checkpoint); results.parquet
    is not written.
    """
    check_trials(spec)
    check_folder(Path(out))
    folder = Path(out).resolve() / spec.name
    trainable = tune.with_resources(tune.with_parameters(run_trial, folder=str(folder), callbacks=tuple(callbacks),
                                                         command=command),
                                    tune.PlacementGroupFactory(spec.bundles, strategy="PACK"))
    if resume and not tune.Tuner.can_restore(str(folder)):
        raise FedrayError(f"{folder}: no sweep to resume")
    if not resume and folder.exists():
        raise FedrayError(f"{folder}: a sweep named {spec.name!r} is already there; use --resume or another --out")
    remove_stale_temporaries(folder, [RESULTS])
    init_ray(address)
    parked.release()  # the shards an earlier run of this process parked give way to the trials' placement groups
    check_bundles_fit(spec.bundles, f"one trial's driver ({spec.driver_cpus:g} CPU) and {spec.shards_per_trial} shards × "
                      f"{spec.shard_bundle}", "lower driver_cpus, shards_per_trial, cpus_per_shard or gpus_per_shard")
    if resume:
        tuner = tune.Tuner.restore(str(folder), trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=param_space(spec),
            # a finished trial's process (ray, fedray and torch imported) and its shards run the next trial
            tune_config=tune.TuneConfig(metric="accuracy", mode="max", num_samples=spec.num_samples, reuse_actors=True),
            run_config=tune.RunConfig(name=spec.name, storage_path=str(folder.parent), verbose=0 if quiet else 1),
        )
    with _without_tune_s_failure_messages(), _environment("RAY_AIR_NEW_OUTPUT", "0") if quiet else nullcontext():
        # --quiet: Tune's legacy output, silent at verbosity 0 (the new one prints its configuration, folders and a
        # line per failed trial at any verbosity).
        grid = tuner.fit()
    failed = [result for result in grid if result.error is not None]
    if len(failed) + sum(map(_finished, grid)) < len(grid):
        # Tune catches Ctrl-C itself: it stops the trials (as if they had ended), saves its state and returns.
        raise KeyboardInterrupt(f"sweep {spec.name} interrupted; its state is saved in {folder}")
    for result in failed:
        print(f"fedray: trial {_trial_name(spec, result)} failed: {failure_line(result.error)}", file=sys.stderr)
    if failed and len(failed) == len(grid):
        raise FedrayError(f"all {len(grid)} trials failed (first: {failure_line(failed[0].error)}), so no {RESULTS}; "
                          f"fix and rerun with --resume (each trial's error is in {folder})")
    table = combine(spec, grid)
    write_atomically(folder / RESULTS, table.write_parquet)
    if failed:
        raise FedrayError(f"{len(failed)} of {len(grid)} trials failed (first: {failure_line(failed[0].error)}); "
                          f"finished trials are in {folder / RESULTS}; fix and rerun with --resume")
    return table


def _finished(result: tune.Result) -> bool:
    """Whether the trial's run completed: its metrics.parquet, written last, is there."""
    return result.error is None and result.path is not None and (Path(result.path) / METRICS).is_file()


def failure_line(error: BaseException) -> str:
    """A failed trial's error in one line: fedray's own message, the plugin that raised and the call into it, else the
    exception's type and message, never Ray's actor wrapper (its first line is ``ray::ImplicitFunc.train() (pid=...)``
    in colour)."""
    failure = plugin_failure(error)  # from the whole error: a RayTaskError's text holds the trial's traceback
    cause = getattr(error, "cause", None)  # a RayTaskError carries the trial's own exception
    error = cause if isinstance(cause, BaseException) else error
    if isinstance(error, FedrayError):
        return str(error)
    if failure is not None:
        return failure
    message = ANSI_CODES.sub("", str(error)).strip().splitlines()
    return f"{type(error).__name__}: {message[0]}" if message else type(error).__name__


def combine(spec: SweepSpec, grid: tune.ResultGrid) -> pl.DataFrame:
    """All finished trials' metrics rows (there is at least one), with the trial id, each swept dataset option and
    what made the trial (its run.json's fields, as ``env_NAME``) as columns, in trial order.

    Trials of different methods have different columns (each row holds the options that apply to its run): a column
    a trial lacks is null in its rows.
    """
    frames = []
    for result in filter(_finished, grid):
        frame = pl.read_parquet(Path(result.path) / METRICS)
        trial_id = result.metrics.get("trial_id", Path(result.path).name)
        swept = {key: result.config[key] for key in spec.swept if key.startswith(DATASET_PREFIX)}
        frames.append(frame.with_columns(pl.lit(trial_id).alias("trial_id"),
                                         *(pl.lit(v).alias(k) for k, v in swept.items()),
                                         *_environment_columns(Path(result.path) / RUN_JSON)))
    table = pl.concat(frames, how="diagonal_relaxed").with_columns(pl.lit(spec.name).alias("sweep"))
    return table.sort(["trial_id", "round"])


def _environment_columns(record: Path) -> list[pl.Expr]:
    """A trial's run.json fields as columns ``env_NAME``, typed; null where a trial has none (an earlier fedray's)."""
    made = json.loads(record.read_text()) if record.is_file() else {}
    return [pl.lit(made.get(name), dtype=COLUMN_TYPES[kind]).alias(ENVIRONMENT_PREFIX + name)
            for name, kind in FIELDS.items()]
