"""Reading result tables: any mix of sweep ``results.parquet`` files, run ``metrics.parquet`` files, or folders of them."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import polars as pl

from fedray.core.results import EvalPoint

RESULTS, METRICS = "results.parquet", "metrics.parquet"
METRIC_COLUMNS = tuple(f.name for f in fields(EvalPoint))
NOT_PARAMETERS = {*METRIC_COLUMNS, "trial_id", "sweep", "method", "seed", "out", "quiet", "num_shards", "cpus_per_shard",
                  "label", "section"}


def result_files(paths: list[str | Path]) -> list[Path]:
    """Each path itself, or the sweep results (else run metrics) found under a folder."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.rglob(RESULTS)) or sorted(path.rglob(METRICS))
            if not found:
                raise SystemExit(f"{path}: no {RESULTS} or {METRICS} under this folder")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise SystemExit(f"{path}: no such file or folder")
    return files


def read_results(paths: list[str | Path]) -> pl.DataFrame:
    """All evaluation rows, one ``trial_id`` per run (a run's folder name when it has none)."""
    frames = []
    for file in result_files(paths):
        frame = pl.read_parquet(file)
        if "trial_id" not in frame.columns:
            frame = frame.with_columns(pl.lit(str(file.parent)).alias("trial_id"))
        frames.append(frame)
    return pl.concat(frames, how="diagonal_relaxed").sort(["trial_id", "round"])


def varying_parameters(results: pl.DataFrame, by: str = "method") -> list[str]:
    """The configuration columns that vary across runs: the sweep's axes.

    A run's row holds only the options that apply to its method (a null elsewhere, e.g. ``lam`` on a FedAvg row
    beside Fed3R's), so a column varies when it takes two values among one method's runs (null counted), or two
    values that are not null across methods; a null beside a value of another method is not a difference.
    ``by="label"`` (runs named by a job's configurations, e.g. ``"fedcof-oracle (diagonal)"``): only what varies
    among one label's runs (its dataset); what differs between labels is the label's to say.
    """
    candidates = [c for c in results.columns if c not in NOT_PARAMETERS]
    if not candidates:
        return []
    per_group = results.group_by(by).agg(pl.col(candidates).n_unique()).select(pl.col(candidates).max())
    if by != "method":
        return [c for c in candidates if per_group[c].item() > 1]
    across = results.select(pl.col(candidates).drop_nulls().n_unique())
    return [c for c in candidates if per_group[c].item() > 1 or across[c].item() > 1]


def final_rows(results: pl.DataFrame) -> pl.DataFrame:
    return results.filter(pl.col("round") == pl.col("round").max().over("trial_id"))
