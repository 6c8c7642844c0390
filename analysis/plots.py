"""Plots in the papers' style: accuracy against rounds, cumulative upload (log x) and client compute (log x).

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

from analysis.results import one_line_errors, read_results, varying_parameters
from fedray.core.results import write_atomically

LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "x")
PANELS = (
    ("round", "rounds", "linear"),
    ("bytes_up", "cumulative upload (bytes)", "log"),
    ("flops_client_avg", "average client compute (FLOPs)", "log"),
)


def curves(results: pl.DataFrame, axis: str | None) -> pl.DataFrame:
    """Mean and spread of accuracy per (method, axis value, round), with the mean x of each panel."""
    keys = ["method"] + ([axis] if axis else [])
    return (
        results.group_by([*keys, "round"])
        .agg(
            pl.col("accuracy").mean().alias("mean"),
            pl.col("accuracy").min().alias("low"),
            pl.col("accuracy").max().alias("high"),
            pl.col("bytes_up").mean(),
            pl.col("flops_client_avg").mean(),
        )
        .sort([*keys, "round"])
    )


def figure(results: pl.DataFrame, axis: str | None) -> plt.Figure:
    """Colour by method, line style and marker by the axis value."""
    fig, panels = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), sharey=True)
    data = curves(results, axis)
    keys = ["method"] + ([axis] if axis else [])
    colours = {m: f"C{i % 10}" for i, m in enumerate(data["method"].unique(maintain_order=True))}
    values = data[axis].unique(maintain_order=True).to_list() if axis else [None]
    for group_key, line in data.group_by(keys, maintain_order=True):
        label = str(group_key[0]) if axis is None else f"{group_key[0]}, {axis}={group_key[1]}"
        index = values.index(group_key[1] if axis else None)
        style = {"color": colours[group_key[0]], "linestyle": LINESTYLES[index % len(LINESTYLES)],
                 "marker": MARKERS[index % len(MARKERS)], "markersize": 4}
        for panel, (x, xlabel, scale) in zip(panels, PANELS):
            shown = line.filter(pl.col(x) > 0) if scale == "log" else line
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
