"""Compare runs side by side: the last evaluation point of each run, as a table.

    fedray compare RUN...                    (or: python -m analysis.compare RUN...)

A RUN is a run's folder or its ``metrics.parquet``, a sweep's folder or its
``results.parquet`` (a row per trial), or any folder of them
(``fedray compare results/quickstart/*``, or ``results/quickstart``). A row:
method, dataset, the parameters that vary across the runs (as
:mod:`analysis.summarize` finds them), final test accuracy in %, rounds,
clients seen, upload in MB, wall-clock seconds.

``--by clock`` compares runs on the virtual clock (each must have one:
``clock_s`` in its rows): the table shows virtual hours, their compute and
communication split, stragglers and dropped clients instead of wall-clock
seconds, and a second table the virtual hours each run took to first reach
25/50/75/90 % of the best final accuracy over the runs compared, with the
round, the traffic and the stragglers by then (:mod:`analysis.clock`).
``--plot FILE`` (``.png``, ``.svg`` or ``.pdf``) also draws accuracy against
the rounds or the virtual hours, a line per run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from analysis import clock
from analysis.results import best_final_accuracy, one_line_errors, read_results, varying_parameters
from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.core.writable import check_file

pl = lazy_module("polars", globals())

COLUMNS = ("method", "dataset", "round", "accuracy", "clients_seen", "bytes_up", "wall_s")
"""The columns a table needs to be compared."""
SHOWN = ("method", "dataset", "accuracy_%", "rounds", "clients_seen", "upload_MB", "wall_s", "virtual_h", "compute_h",
         "comm_h", "level", "target_%", "round", "download_MB")
"""The tables' own columns: a varying parameter of the same name (``--rounds``, the budget) is what they show."""
AXES = {"round": ("round", "rounds"), "clock": ("virtual_h", "virtual time (hours)")}
"""Per ``--by``: the x of the plot (a column of :func:`curve_points`) and its label."""
PLOT_FORMATS = (".png", ".svg", ".pdf")


def read_compared(paths: list[str], by: str = "round") -> pl.DataFrame:
    """Every evaluation row of the runs; ``by="clock"`` refuses a run without a clock."""
    results = read_results(paths, required=COLUMNS)
    if by == "clock":
        clock.check_clock(results)
    return results


def final_points(results: pl.DataFrame) -> pl.DataFrame:
    """One row per run, in the order the runs come: its last evaluation point."""
    return results.group_by("trial_id", maintain_order=True).last()


def run_keys(finals: pl.DataFrame) -> list[str]:
    """What tells the runs apart besides method and dataset: the parameters that vary, the seed where it does."""
    seeds = ["seed"] if "seed" in finals.columns and finals["seed"].n_unique() > 1 else []
    return [name for name in (*varying_parameters(finals), *seeds) if name not in SHOWN]


def final_table(results: pl.DataFrame, by: str = "round") -> pl.DataFrame:
    """A row per run: its last evaluation point, wall-clock seconds (``by="round"``) or its place on the clock."""
    finals = final_points(results)
    timing = clock.clock_columns(finals) if by == "clock" else [pl.col("wall_s").round(1)]
    return finals.select(
        pl.col("method"),
        pl.col("dataset"),
        *run_keys(finals),
        (pl.col("accuracy") * 100).round(2).alias("accuracy_%"),
        pl.col("round").alias("rounds"),
        pl.col("clients_seen"),
        (pl.col("bytes_up") / 1e6).round(1).alias("upload_MB"),
        *timing,
    )


def comparison_table(paths: list[str], by: str = "round") -> pl.DataFrame:
    return final_table(read_compared(paths, by), by)


def time_table(results: pl.DataFrame) -> pl.DataFrame:
    """:func:`analysis.clock.time_to_accuracy` of the runs, each named as in :func:`final_table`."""
    return clock.time_to_accuracy(results, ["method", *run_keys(final_points(results))])


def curve_points(results: pl.DataFrame) -> pl.DataFrame:
    """Each run's evaluation points for the plot: its ``label`` (method and :func:`run_keys`), round, virtual hours
    (on the clock) and accuracy in %."""
    keys = run_keys(final_points(results))
    label = pl.concat_str([pl.col("method"), *(pl.format(f"{key}={{}}", pl.col(key)) for key in keys)],
                          separator=", ", ignore_nulls=True)
    on_clock = [(pl.col("clock_s") / clock.SECONDS_PER_HOUR).alias("virtual_h")] if "clock_s" in results.columns else []
    return results.select("trial_id", label.alias("label"), "round", *on_clock,
                          (pl.col("accuracy") * 100).alias("accuracy_%"))


def print_table(table: pl.DataFrame) -> None:
    with pl.Config(
        tbl_rows=-1, tbl_cols=-1, tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True,
        tbl_width_chars=160, fmt_str_lengths=60,
    ):
        print(table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments (``fedray compare`` and ``python -m analysis.compare`` take the same)."""
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a run's folder or metrics.parquet, a sweep's folder "
                        "or results.parquet, or a folder of them")
    parser.add_argument("--by", choices=tuple(AXES), default="round",
                        help="round: the last evaluation point and wall-clock seconds (default); clock: on the virtual "
                        "clock (virtual hours, stragglers) and the virtual hours to 25/50/75/90%% of the best final "
                        "accuracy; every run must have a clock")
    parser.add_argument("--plot", metavar="FILE", help="also draw accuracy against the rounds or the virtual hours "
                        "(--by), a line per run, to FILE (.png, .svg or .pdf)")


def check_plot_file(path: str) -> None:
    """Refuse, before any work, a ``--plot`` file of another format or where no file can be written."""
    if Path(path).suffix.lower() not in PLOT_FORMATS:
        raise FedrayError(f"--plot {path}: name a {', '.join(PLOT_FORMATS[:-1])} or {PLOT_FORMATS[-1]} file")
    if Path(path).is_dir():
        raise FedrayError(f"--plot {path}: is a folder; name the file to write, e.g. {Path(path) / 'accuracy.png'}")
    check_file(Path(path), "--plot")


def compare(args: argparse.Namespace) -> None:
    """Print the runs' table (and ``--by clock`` their time to accuracy); draw ``--plot``."""
    by = args.by
    if args.plot is not None:
        check_plot_file(args.plot)
    results = read_compared(args.runs, by)
    if by == "clock":
        print("runs on the virtual clock: the last evaluation point of each")
    print_table(final_table(results, by))
    if by == "clock":
        print(f"virtual hours to a fraction of the best final accuracy over these runs "
              f"({100 * best_final_accuracy(results):.2f}%): each run's first evaluation at or above it")
        print_table(time_table(results))
    if args.plot is not None:
        from analysis import plots  # matplotlib only where a plot is asked for: every ``fedray`` command imports this

        x, xlabel = AXES[by]
        plots.write_figure(plots.accuracy_per_run(curve_points(results), x, xlabel), Path(args.plot))
        print(args.plot)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m analysis.compare", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    with one_line_errors(parser.prog):
        compare(args)


if __name__ == "__main__":
    main()
