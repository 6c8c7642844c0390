"""Summary tables of finished runs: per method × swept parameter, mean ± std over seeds.

    fedray summarize RESULTS... [--out DIR] [--target 0.5]    (or: python -m analysis.summarize ...)

RESULTS are sweep ``results.parquet`` files, run ``metrics.parquet`` files or
folders holding them (as :mod:`analysis.compare` takes them). Prints a
markdown table, and with ``--out`` writes it to ``DIR/summary.md`` and as
``DIR/summary.csv``, with, per group: the number of seeds, the final accuracy,
the upload (in all, and per client that took part: ``bytes_up /
clients_seen``), and the rounds and upload bytes each run needed to first
reach the target accuracy (empty where a run never reached it). A group is a
method × the swept parameters, or, where the rows carry a ``label`` (a job's
named configurations, as ``jobs.sweep_baselines`` writes them), a label × what
varies among its runs (the dataset), in the order the runs come in RESULTS.
The default target is 90% of the lowest final accuracy of any run, so that
every run reaches it; it is written above the table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from analysis.results import final_rows, one_line_errors, read_results, varying_parameters
from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.core.results import write_atomically
from fedray.core.writable import check_folder

pl = lazy_module("polars", globals())

TARGET_SHARE = 0.9
COLUMNS = ("round", "accuracy", "bytes_up", "clients_seen")
"""The columns a table needs to be summarized (and ``method``, or ``label``)."""


def reach(results: pl.DataFrame, target: float) -> pl.DataFrame:
    """Per run: the first round, and the upload bytes by then, at which accuracy ≥ ``target`` (null if never)."""
    first = (
        results.filter(pl.col("accuracy") >= target)
        .group_by("trial_id")
        .agg(pl.col("round").min().alias("rounds_to_target"), pl.col("bytes_up").sort_by("round").first().alias("bytes_to_target"))
    )
    runs = results.select("trial_id").unique()
    return runs.join(first, on="trial_id", how="left")


def groups_of(results: pl.DataFrame) -> list[str]:
    """The columns that make a row of the table: the label and what varies among one label's runs where the runs
    are labelled, else the method and the swept parameters."""
    if "label" in results.columns:
        return [*varying_parameters(results, by="label"), "label"]
    return ["method", *varying_parameters(results)]


def summarize(results: pl.DataFrame, target: float | None = None) -> tuple[pl.DataFrame, float]:
    groups = groups_of(results)
    finals = final_rows(results.with_row_index("position"))
    if target is None:
        target = TARGET_SHARE * finals["accuracy"].min()
    runs = finals.join(reach(results, target), on="trial_id")
    table = (
        runs.group_by(groups)
        .agg(
            pl.len().alias("seeds"),
            pl.col("accuracy").mean().alias("accuracy_mean"),
            pl.col("accuracy").std().fill_null(0.0).alias("accuracy_std"),
            pl.col("round").mean().alias("rounds"),
            pl.col("bytes_up").mean().alias("upload_bytes"),
            (pl.col("bytes_up") / pl.col("clients_seen")).mean().alias("upload_bytes_per_client"),
            pl.col("rounds_to_target").mean().alias("rounds_to_target_mean"),
            pl.col("rounds_to_target").std().alias("rounds_to_target_std"),
            pl.col("bytes_to_target").mean().alias("upload_bytes_to_target_mean"),
            pl.col("rounds_to_target").null_count().alias("runs_not_reaching_target"),
            pl.col("position").min().alias("first_position"),
        )
    )
    order = ["first_position"] if "label" in groups else groups  # a job's labels in its table's order
    return table.sort(order).drop("first_position"), target


def markdown(table: pl.DataFrame, target: float) -> str:
    """The table for a paper draft: accuracy in %, traffic in MB (per client to 4 significant digits), ± over seeds."""
    groups = [c for c in table.columns if c not in ("seeds",) and not c.startswith(("accuracy", "rounds", "upload", "runs_"))]
    header = [*groups, "seeds", "final accuracy (%)", "rounds", "upload (MB)", "upload per client (MB)", f"rounds to {100 * target:.2f}%", f"upload to {100 * target:.2f}% (MB)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table.iter_rows(named=True):
        reached = row["rounds_to_target_mean"] is not None
        cells = [str(row[g]) for g in groups] + [
            str(row["seeds"]),
            f"{100 * row['accuracy_mean']:.2f} ± {100 * row['accuracy_std']:.2f}",
            f"{row['rounds']:.0f}",
            f"{row['upload_bytes'] / 1e6:.1f}",
            f"{row['upload_bytes_per_client'] / 1e6:.4g}",
            f"{row['rounds_to_target_mean']:.0f} ± {row['rounds_to_target_std'] or 0:.0f}" if reached else "not reached",
            f"{row['upload_bytes_to_target_mean'] / 1e6:.1f}" if reached else "—",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_text(results: pl.DataFrame, target: float | None = None) -> tuple[pl.DataFrame, str]:
    """The summary table and its markdown, the target accuracy written above it."""
    table, target = summarize(results, target)
    return table, f"Target accuracy: {100 * target:.2f}%\n\n" + markdown(table, target)


def write_summary(results: pl.DataFrame, out: Path, target: float | None = None) -> str:
    """Write ``out/summary.csv`` and ``out/summary.md``; returns the markdown."""
    table, text = summary_text(results, target)
    write_atomically(out / "summary.csv", table.write_csv)
    write_atomically(out / "summary.md", lambda path: path.write_text(text))
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments (``fedray summarize`` and ``python -m analysis.summarize`` take the same)."""
    parser.add_argument("results", nargs="+", metavar="RESULTS", help="a sweep's folder or results.parquet, a run's "
                        "folder or metrics.parquet, or a folder of them")
    parser.add_argument("--out", help="also write the table to OUT/summary.md and OUT/summary.csv")
    parser.add_argument("--target", type=float,
                        help="target accuracy in [0, 1] (default: 90%% of the lowest final accuracy)")


def summarize_results(args: argparse.Namespace) -> None:
    """Print the summary of ``args.results`` (and write it to ``args.out``)."""
    if args.target is not None and not 0 <= args.target <= 1:
        raise FedrayError(f"--target must be an accuracy in [0, 1], got {args.target}")
    if args.out is not None:
        check_folder(Path(args.out))
    results = read_results(args.results, required=COLUMNS)
    if "method" not in results.columns and "label" not in results.columns:
        raise FedrayError("no method or label column in the tables given: not runs' metrics.parquet or sweeps' "
                          "results.parquet")
    print(write_summary(results, Path(args.out), args.target) if args.out else summary_text(results, args.target)[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m analysis.summarize", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    with one_line_errors(parser.prog):
        summarize_results(args)


if __name__ == "__main__":
    main()
