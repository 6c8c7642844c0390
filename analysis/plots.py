"""Plots in the papers' style: accuracy against rounds, cumulative upload (log x), client compute (log x) and, for
runs on the clock, virtual hours.

    python -m analysis.plots RESULTS... --out DIR [--format png svg]

One figure per sweep axis (each configuration column that varies across the
runs; one figure named ``runs`` when nothing varies): a line per method and
value of that axis, the mean over every run sharing them (seeds and the other
axes), with the spread over those runs shaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import polars as pl

from analysis.clock import SECONDS_PER_HOUR
from analysis.results import one_line_errors, read_results, varying_parameters
from fedray.core.results import write_atomically

LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "x")
PANELS = (
    ("round", "rounds", "linear"),
    ("bytes_up", "cumulative upload (bytes)", "log"),
    ("flops_client_avg", "average client compute (FLOPs)", "log"),
)
CLOCK_PANEL = ("clock_h", "virtual time (hours)", "linear")
"""The panel added when runs have a clock: their ``clock_s`` in hours."""


def panels_of(results: pl.DataFrame) -> tuple[tuple[str, str, str], ...]:
    """:data:`PANELS`, and :data:`CLOCK_PANEL` where any run has a clock (a run without one has no line there)."""
    clocked = "clock_s" in results.columns and results["clock_s"].is_not_null().any()
    return (*PANELS, CLOCK_PANEL) if clocked else PANELS


def curves(results: pl.DataFrame, axis: str | None) -> pl.DataFrame:
    """Mean and spread of accuracy per (method, axis value, round), with the mean x of each panel."""
    keys = ["method"] + ([axis] if axis else [])
    on_clock = CLOCK_PANEL in panels_of(results)
    clock_h = [(pl.col("clock_s") / SECONDS_PER_HOUR).mean().alias("clock_h")] if on_clock else []
    return (
        results.group_by([*keys, "round"])
        .agg(
            pl.col("accuracy").mean().alias("mean"),
            pl.col("accuracy").min().alias("low"),
            pl.col("accuracy").max().alias("high"),
            pl.col("bytes_up").mean(),
            pl.col("flops_client_avg").mean(),
            *clock_h,
        )
        .sort([*keys, "round"])
    )


def figure(results: pl.DataFrame, axis: str | None) -> plt.Figure:
    """Colour by method, line style and marker by the axis value."""
    shown_panels = panels_of(results)
    fig, panels = plt.subplots(1, len(shown_panels), figsize=(5 * len(shown_panels), 4), sharey=True)
    data = curves(results, axis)
    keys = ["method"] + ([axis] if axis else [])
    colours = {m: f"C{i % 10}" for i, m in enumerate(data["method"].unique(maintain_order=True))}
    values = data[axis].unique(maintain_order=True).to_list() if axis else [None]
    for group_key, line in data.group_by(keys, maintain_order=True):
        label = str(group_key[0]) if axis is None else f"{group_key[0]}, {axis}={group_key[1]}"
        index = values.index(group_key[1] if axis else None)
        style = {"color": colours[group_key[0]], "linestyle": LINESTYLES[index % len(LINESTYLES)],
                 "marker": MARKERS[index % len(MARKERS)], "markersize": 4}
        for panel, (x, xlabel, scale) in zip(panels, shown_panels):
            shown = line.filter(pl.col(x) > 0) if scale == "log" else line.drop_nulls(x)
            panel.plot(shown[x], 100 * shown["mean"], label=label, **style)
            panel.fill_between(shown[x], 100 * shown["low"], 100 * shown["high"], color=style["color"], alpha=0.15)
            panel.set_xscale(scale)
            panel.set_xlabel(xlabel)
            panel.grid(True, alpha=0.3)
    panels[0].set_ylabel("test accuracy (%)")
    panels[-1].legend(fontsize="small", loc="lower right")
    fig.suptitle("all runs" if axis is None else f"by {axis}")
    fig.tight_layout()
    return fig


def plot_all(results: pl.DataFrame, out: Path, formats: tuple[str, ...] = ("png", "svg")) -> list[Path]:
    """Write one figure per sweep axis in each format; returns the files written."""
    written = []
    for axis in varying_parameters(results) or [None]:
        fig = figure(results, axis)
        for fmt in formats:
            path = out / f"{axis or 'runs'}.{fmt}"
            write_atomically(path, lambda p, fmt=fmt: fig.savefig(p, format=fmt, dpi=120))
            written.append(path)
        plt.close(fig)
    return written


def accuracy_per_run(points: pl.DataFrame, x: str, xlabel: str) -> plt.Figure:
    """Accuracy (``accuracy_%``) against ``x``, a line per run (``trial_id``) named by its ``label``, in their order."""
    fig, panel = plt.subplots(figsize=(7, 4.5))
    for index, ((_, label), line) in enumerate(points.group_by("trial_id", "label", maintain_order=True)):
        shown = line.drop_nulls(x)
        panel.plot(shown[x], shown["accuracy_%"], label=label, color=f"C{index % 10}",
                   marker=MARKERS[index // 10 % len(MARKERS)], markersize=4)
    panel.set_xlabel(xlabel)
    panel.set_ylabel("test accuracy (%)")
    panel.grid(True, alpha=0.3)
    panel.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    return fig


def write_figure(fig: plt.Figure, path: Path) -> None:
    """Write ``fig`` to ``path`` (its suffix the format) atomically, and close it."""
    write_atomically(path, lambda p: fig.savefig(p, format=path.suffix[1:].lower(), dpi=120))
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m analysis.plots", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="results.parquet / metrics.parquet files or folders")
    parser.add_argument("--out", required=True, help="folder for the figures")
    parser.add_argument("--format", nargs="+", default=["png", "svg"], choices=["png", "svg", "pdf"])
    args = parser.parse_args(argv)
    with one_line_errors(parser.prog):
        results = read_results(args.results)
    for path in plot_all(results, Path(args.out), tuple(args.format)):
        print(path)


if __name__ == "__main__":
    main()
