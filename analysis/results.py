"""Reading result tables: any mix of sweep ``results.parquet`` files, run ``metrics.parquet`` files, or folders of them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.core.results import ENVIRONMENT_PREFIX, EvalPoint

pl = lazy_module("polars", globals())

RESULTS, METRICS = "results.parquet", "metrics.parquet"
SOURCE = "__source"
"""A column that numbers the files read, while their rows are put in order."""
METRIC_COLUMNS = tuple(f.name for f in fields(EvalPoint))
CLOCK_COLUMNS = ("clock_s", "clock_compute_s", "clock_comm_s", "clients_straggled", "clients_dropped")
"""What a run on the virtual clock adds to its rows, absent from a run without one: virtual seconds since the run's
start, their split into compute and communication, and the stragglers and dropped clients so far (where they apply)."""
ASYNCHRONOUS_COLUMNS = ("aggregations", "staleness_mean", "staleness_max")
"""What a run under an asynchronous scheduler (``--scheduler fedbuff|fedasync``) adds to its rows besides
:data:`CLOCK_COLUMNS`: the server steps so far, and the mean and largest staleness of the updates they aggregated
since the row before."""
NOT_PARAMETERS = {*METRIC_COLUMNS, *CLOCK_COLUMNS, *ASYNCHRONOUS_COLUMNS, "trial_id", "sweep", "method", "seed", "out",
                  "quiet", "num_shards", "cpus_per_shard", "label", "section"}


@contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """A script's bad input (a :class:`FedrayError` inside) ends it with one line, as argparse's errors do."""
    try:
        yield
    except FedrayError as error:
        raise SystemExit(f"{prog}: error: {error}") from None


def result_files(paths: list[str | Path]) -> list[Path]:
    """Each path itself, or the tables found under a folder: every sweep's ``results.parquet``, and every run's
    ``metrics.parquet`` outside those sweeps' folders (their trials are in their ``results.parquet``). Each file once,
    in the order given."""
    files: dict[Path, None] = {}
    for path in map(Path, paths):
        if path.is_dir():
            sweeps = sorted(path.rglob(RESULTS))
            runs = [run for run in sorted(path.rglob(METRICS))
                    if not any(sweep.parent in run.parents for sweep in sweeps)]
            if not sweeps and not runs:
                raise FedrayError(f"{path}: no {RESULTS} or {METRICS} under this folder")
            files.update(dict.fromkeys(sorted(sweeps + runs)))
        elif path.is_file():
            files[path] = None
        else:
            raise FedrayError(f"{path}: no such file or folder")
    return list(files)


def read_results(paths: list[str | Path], required: tuple[str, ...] = ("round", "accuracy")) -> pl.DataFrame:
    """All evaluation rows, one ``trial_id`` per run (a run's folder name when it has none), the runs in the order
    ``paths`` gives them. A file that is not a table with the ``required`` columns is refused in one line naming it,
    before any is read."""
    files = result_files(paths)
    for file in files:
        missing = [column for column in required if column not in table_schema(file)]
        if missing:
            raise FedrayError(f"{file}: no {', '.join(missing)} column{'s' if len(missing) > 1 else ''}: "
                              f"not a run's {METRICS} or a sweep's {RESULTS}")
    frames = []
    for position, file in enumerate(files):
        frame = pl.read_parquet(file)
        if "trial_id" not in frame.columns:
            frame = frame.with_columns(pl.lit(str(file.parent)).alias("trial_id"))
        frames.append(frame.with_columns(pl.lit(position).alias(SOURCE)))
    results = pl.concat(frames, how="diagonal_relaxed")
    return results.sort([SOURCE, "trial_id", "round"], maintain_order=True).drop(SOURCE)


def table_schema(file: Path) -> pl.Schema:
    """The columns of the Parquet table ``file``, or a one-line error naming it."""
    try:
        return pl.read_parquet_schema(file)
    except (pl.exceptions.PolarsError, OSError) as error:
        reason = " ".join(str(error).split())
        raise FedrayError(f"{file}: not a Parquet table ({reason})") from None


def varying_parameters(results: pl.DataFrame, by: str = "method") -> list[str]:
    """The configuration columns that vary across runs: the sweep's axes.

    A run's row holds only the options that apply to its method (a null elsewhere, e.g. ``lam`` on a FedAvg row
    beside Fed3R's), so a column varies when it takes two values among one method's runs (null counted), or two
    values that are not null across methods; a null beside a value of another method is not a difference.
    ``by="label"`` (runs named by a job's configurations, e.g. ``"fedcof-oracle (diagonal)"``): only what varies
    among one label's runs (its dataset); what differs between labels is the label's to say. What made each run
    (a sweep's ``env_`` columns: versions, times) is not a parameter.
    """
    candidates = [c for c in results.columns if c not in NOT_PARAMETERS and not c.startswith(ENVIRONMENT_PREFIX)]
    if not candidates:
        return []
    per_group = results.group_by(by).agg(pl.col(candidates).n_unique()).select(pl.col(candidates).max())
    if by != "method":
        return [c for c in candidates if per_group[c].item() > 1]
    across = results.select(pl.col(candidates).drop_nulls().n_unique())
    return [c for c in candidates if per_group[c].item() > 1 or across[c].item() > 1]


def runs_without_clock(results: pl.DataFrame) -> list[str]:
    """The runs none of whose rows has a ``clock_s``, each named as a user can find it: a run's folder, or ``trial T of
    sweep S``."""
    clocked = pl.col("clock_s").is_not_null().any() if "clock_s" in results.columns else pl.lit(False)
    sweep = pl.col("sweep") if "sweep" in results.columns else pl.lit(None, pl.String)
    trial = pl.col("trial_id")
    name = pl.when(sweep.is_null()).then(trial).otherwise("trial " + trial + " of sweep " + sweep)
    runs = results.group_by("trial_id", maintain_order=True).agg(clocked.alias("clocked"), name.first().alias("name"))
    return runs.filter(~pl.col("clocked"))["name"].to_list()


def final_rows(results: pl.DataFrame) -> pl.DataFrame:
    return results.filter(pl.col("round") == pl.col("round").max().over("trial_id"))


def best_final_accuracy(results: pl.DataFrame) -> float:
    """The best of the runs' final accuracies: what targets given as fractions are fractions of."""
    return final_rows(results)["accuracy"].max()


def first_reaching(results: pl.DataFrame, fractions: list[float]) -> pl.DataFrame:
    """Per run and fraction (runs in their order, then fractions in theirs): the run's first evaluation row whose
    accuracy is at or above that fraction of :func:`best_final_accuracy`, as it is (not interpolated between rows),
    after ``trial_id``, ``level`` (the fraction) and ``target`` (the accuracy); where a run never reaches it, those
    three and the rest null."""
    best = best_final_accuracy(results)
    levels = pl.DataFrame({"level": fractions, "target": [fraction * best for fraction in fractions]},
                          schema={"level": pl.Float64, "target": pl.Float64})
    reached = (
        results.join(levels, how="cross", maintain_order="left_right")
        .filter(pl.col("accuracy") >= pl.col("target"))
        .unique(["trial_id", "level"], keep="first", maintain_order=True)
        .drop("target")
    )
    runs = results.select("trial_id").unique(maintain_order=True).join(levels, how="cross", maintain_order="left_right")
    return runs.join(reached, on=["trial_id", "level"], how="left", maintain_order="left")
