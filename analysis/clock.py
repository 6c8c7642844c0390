"""Runs on the virtual clock: where each run stands at its last evaluation, and the virtual hours it took to reach
fractions of the best accuracy, with the traffic and stragglers by then.

A run has a clock when its rows carry ``clock_s`` (virtual seconds since its start; see
:data:`analysis.results.CLOCK_COLUMNS`). Time to accuracy follows :func:`analysis.convergence.rounds_to_reach`'s
rule: the targets are fractions of the best final accuracy over the runs read together, and a run reaches one at its
first evaluation row at or above it, that row's clock as it is (no interpolation between evaluations).
"""

from __future__ import annotations

from analysis.results import first_reaching, runs_without_clock
from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module

pl = lazy_module("polars", globals())

LEVELS = (0.25, 0.5, 0.75, 0.9)
"""The fractions of the best final accuracy that time to accuracy is read at."""
SECONDS_PER_HOUR = 3600
SHOWN_FIGURES = 4
"""Significant figures of the virtual hours shown: a closed-form run takes seconds, a training run days."""


def check_clock(results: pl.DataFrame) -> None:
    """Refuse, in one line naming it, the first run without a clock."""
    missing = runs_without_clock(results)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise FedrayError(f"{missing[0]}{more}: a run without a clock (no clock_s column) cannot be compared --by "
                          "clock; compare it --by round, or run it on the clock (--devices, --availability, "
                          "--deadline)")


def hours(column: str) -> pl.Expr:
    """Virtual seconds ``column`` in hours, to :data:`SHOWN_FIGURES` significant figures."""
    return (pl.col(column) / SECONDS_PER_HOUR).round_sig_figs(SHOWN_FIGURES)


COUNTS = {"clients_straggled": "stragglers", "clients_dropped": "dropped"}
"""The metrics columns of the stragglers and dropped clients so far, by the name a table shows them under (the rows'
``stragglers`` is the ``--stragglers`` policy)."""


def counts(results: pl.DataFrame) -> list[pl.Expr]:
    """The stragglers and dropped clients so far, each where the runs record it."""
    return [pl.col(column).alias(shown) for column, shown in COUNTS.items() if column in results.columns]


def clock_columns(results: pl.DataFrame) -> list[pl.Expr]:
    """A row's place on the clock: ``virtual_h``, its split ``compute_h`` and ``comm_h``, and :func:`counts`."""
    split = [hours(f"clock_{part}_s").alias(f"{part}_h") for part in ("compute", "comm")
             if f"clock_{part}_s" in results.columns]
    return [hours("clock_s").alias("virtual_h"), *split, *counts(results)]


def time_to_accuracy(results: pl.DataFrame, keys: list[str], levels: tuple[float, ...] = LEVELS) -> pl.DataFrame:
    """Per run (named by ``keys``) and level, in that order: the level and its target accuracy in %, and at the
    run's first evaluation at or above it the virtual hours, the round, the upload and (where the rows have it) the
    download in MB, and :func:`counts`; null where the run never reaches it."""
    names = results.select("trial_id", *keys).unique("trial_id", keep="first", maintain_order=True)
    first = first_reaching(results, list(levels)).drop(keys).join(names, on="trial_id", how="left",
                                                                  maintain_order="left")
    return first.select(
        *keys,
        pl.format("{}%", (pl.col("level") * 100).round(0).cast(pl.Int64)).alias("level"),
        (pl.col("target") * 100).round(2).alias("target_%"),
        hours("clock_s").alias("virtual_h"),
        pl.col("round"),
        (pl.col("bytes_up") / 1e6).round(1).alias("upload_MB"),
        *[(pl.col("bytes_down") / 1e6).round(1).alias("download_MB")] if "bytes_down" in first.columns else [],
        *counts(first),
    )
