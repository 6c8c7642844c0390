"""Compare runs side by side: the last evaluation point of each run, as a table.

    fedray compare RUN...                    (or: python -m analysis.compare RUN...)

A RUN is a run's folder or its ``metrics.parquet``, a sweep's folder or its
``results.parquet`` (a row per trial), or any folder of them
(``fedray compare results/quickstart/*``, or ``results/quickstart``). A row:
method, dataset, the parameters that vary across the runs (as
:mod:`analysis.summarize` finds them), final test accuracy in %, rounds,
clients seen, upload in MB, wall-clock seconds.
"""

from __future__ import annotations

import argparse

from analysis.results import one_line_errors, read_results, varying_parameters
from fedray.core.lazy_modules import lazy_module

pl = lazy_module("polars", globals())

COLUMNS = ("method", "dataset", "round", "accuracy", "clients_seen", "bytes_up", "wall_s")
"""The columns a table needs to be compared."""
SHOWN = ("method", "dataset", "accuracy_%", "rounds", "clients_seen", "upload_MB", "wall_s")
"""The table's own columns: a varying parameter of the same name (``--rounds``, the budget) is what they show."""


def final_points(paths: list[str]) -> pl.DataFrame:
    """One row per run, in the order ``paths`` gives them: its last evaluation point."""
    return read_results(paths, required=COLUMNS).group_by("trial_id", maintain_order=True).last()


def comparison_table(paths: list[str]) -> pl.DataFrame:
    finals = final_points(paths)
    seeds = ["seed"] if "seed" in finals.columns and finals["seed"].n_unique() > 1 else []
    varying = [name for name in (*varying_parameters(finals), *seeds) if name not in SHOWN]
    return finals.select(
        pl.col("method"),
        pl.col("dataset"),
        *varying,
        (pl.col("accuracy") * 100).round(2).alias("accuracy_%"),
        pl.col("round").alias("rounds"),
        pl.col("clients_seen"),
        (pl.col("bytes_up") / 1e6).round(1).alias("upload_MB"),
        pl.col("wall_s").round(1),
    )


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


def compare(args: argparse.Namespace) -> None:
    print_table(comparison_table(args.runs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m analysis.compare", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    with one_line_errors(parser.prog):
        compare(args)


if __name__ == "__main__":
    main()
