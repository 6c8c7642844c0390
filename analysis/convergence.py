"""Convergence per round of several runs: accuracy at the same rounds, and rounds needed to reach an accuracy.

    python -m analysis.convergence results/fed3r results/fedavg [--targets 0.25 0.5 0.75 0.9]

Runs are evaluated at different rounds, so a run's accuracy at round r is its
last evaluation at or before r (what a researcher stopping it at r would
report). Targets are fractions of the best final accuracy among the runs.
With ``--by clock`` (runs on the virtual clock only) the second table reads
the virtual hours to each target instead, with the round, the traffic and the
stragglers by then (:func:`analysis.clock.time_to_accuracy`).
"""

from __future__ import annotations

import argparse

import polars as pl

from analysis.clock import check_clock, time_to_accuracy
from analysis.compare import print_table
from analysis.results import best_final_accuracy, one_line_errors, read_results

GRID_POINTS = 8


def run_labels(results: pl.DataFrame) -> pl.DataFrame:
    """``label``: the method, prefixed by its closed-form initialization in two-stage runs."""
    init = pl.col("init") if "init" in results.columns else pl.lit(None, pl.String)
    two_stage = init.is_not_null() & (init != "random") & (pl.col("method") != init)
    return results.with_columns(pl.when(two_stage).then(init + "+" + pl.col("method")).otherwise(pl.col("method")).alias("label"))


def accuracy_at(results: pl.DataFrame, rounds: list[int]) -> pl.DataFrame:
    """One row per run, one column per round: the run's last accuracy at or before that round (null before its first)."""
    grid = pl.DataFrame({"at": rounds}, schema={"at": pl.Int64})
    runs = results.select("trial_id", "label").unique(maintain_order=True)
    wanted = runs.join(grid, how="cross").sort("at")
    evaluated = results.select("trial_id", pl.col("round").cast(pl.Int64).alias("at"), "accuracy").sort("at")
    joined = wanted.join_asof(evaluated, on="at", by="trial_id", strategy="backward", check_sortedness=False)
    return joined.pivot(on="at", index=["trial_id", "label"], values="accuracy").select(
        "label", *[pl.col(str(r)).round(4) for r in rounds]
    )


def rounds_to_reach(results: pl.DataFrame, targets: list[float]) -> pl.DataFrame:
    """First evaluated round at which each run's accuracy reaches each fraction of the best final accuracy."""
    best = best_final_accuracy(results)
    columns = [
        pl.col("round").filter(pl.col("accuracy") >= fraction * best).min().alias(f"rounds_to_{round(fraction * 100)}%")
        for fraction in targets
    ]
    return results.group_by("trial_id", "label", maintain_order=True).agg(
        *columns, pl.col("accuracy").last().round(4).alias("final_accuracy"), pl.col("round").max().alias("rounds")
    ).drop("trial_id")


def evaluation_grid(results: pl.DataFrame, points: int = GRID_POINTS) -> list[int]:
    """Up to ``points`` evaluated rounds spread over the shortest run (rounds all runs reached)."""
    shortest = results.group_by("trial_id").agg(pl.col("round").max())["round"].min()
    rounds = sorted(r for r in results["round"].unique().to_list() if 0 < r <= shortest)
    step = max(1, len(rounds) // points)
    return sorted(set(rounds[step - 1 :: step]) | {rounds[-1]}) if rounds else []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m analysis.convergence", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="metrics.parquet / results.parquet files or folders of them")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.9])
    parser.add_argument("--by", choices=("round", "clock"), default="round",
                        help="what reaching a target is counted in: rounds (default) or virtual hours")
    args = parser.parse_args(argv)
    with one_line_errors(parser.prog):
        results = run_labels(read_results(args.paths))
        if args.by == "clock":
            check_clock(results)
    print("accuracy at the same rounds")
    print_table(accuracy_at(results, evaluation_grid(results)))
    if args.by == "clock":
        print("virtual hours to reach a fraction of the best final accuracy")
        print_table(time_to_accuracy(results, ["label"], tuple(args.targets)))
    else:
        print("rounds to reach a fraction of the best final accuracy")
        print_table(rounds_to_reach(results, args.targets))


if __name__ == "__main__":
    main()
