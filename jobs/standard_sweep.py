"""Run one of the shipped sweeps (``jobs/sweeps/NAME.yaml``) and analyse it: the body of the ``jobs.sweep_*`` entry points.

    python -m jobs.sweep_participation [--out results/sweeps] [--resume] [--quiet]

Writes ``OUT/NAME/results.parquet`` (all trials), ``OUT/NAME/analysis/summary.{md,csv}``
and one figure per sweep axis in ``OUT/NAME/analysis/``. Runs on an embedded
local Ray, or on the cluster of $RAY_ADDRESS (as under ``ray job submit``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from analysis.plots import plot_all
from analysis.summarize import write_summary
from fedray.app.sweeps.spec import load_sweep
from fedray.app.sweeps.tuning import sweep

SWEEPS = Path(__file__).resolve().parent / "sweeps"


def main(name: str, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"the {name} sweep ({SWEEPS / name}.yaml), then its tables and plots")
    parser.add_argument("--out", default="results/sweeps", help="sweeps folder (default %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted sweep")
    parser.add_argument("--quiet", action="store_true", help="no Tune progress table")
    args = parser.parse_args(argv)
    spec = load_sweep(SWEEPS / f"{name}.yaml")
    results = sweep(spec, args.out, resume=args.resume, quiet=args.quiet)
    analysis = Path(args.out) / spec.name / "analysis"
    print(write_summary(results, analysis))
    plot_all(results, analysis)
    print(f"tables and figures: {analysis}")
