"""analysis.convergence on metrics tables with known evaluation points."""

import polars as pl
import pytest

from analysis.convergence import accuracy_at, evaluation_grid, main, rounds_to_reach, run_labels
from analysis.results import read_results


def write_run(folder, method, init, rounds, accuracies):
    folder.mkdir()
    pl.DataFrame({"method": method, "init": init, "round": rounds, "accuracy": accuracies}).write_parquet(folder / "metrics.parquet")
    return folder


def two_runs(tmp_path):
    closed = write_run(tmp_path / "fed3r", "fed3r", "random", [100, 200, 300], [0.5, 0.7, 0.8])
    trained = write_run(tmp_path / "fedavg", "fedavg", "random", [0, 150, 300, 450], [0.0, 0.2, 0.4, 0.6])
    staged = write_run(tmp_path / "staged", "fedavg", "fed3r", [100, 200, 200, 250], [0.5, 0.7, 0.7, 0.75])
    return run_labels(read_results([closed, trained, staged]))


def test_accuracy_at_a_round_is_the_last_evaluation_at_or_before_it(tmp_path):
    table = accuracy_at(two_runs(tmp_path), [100, 150, 250, 300])
    assert table["label"].to_list() == ["fed3r", "fedavg", "fed3r+fedavg"]
    assert table.row(0) == ("fed3r", 0.5, 0.5, 0.7, 0.8)
    assert table.row(1) == ("fedavg", 0.0, 0.2, 0.2, 0.4)
    assert table.row(2) == ("fed3r+fedavg", 0.5, 0.5, 0.75, 0.75)


def test_rounds_to_reach_fractions_of_the_best_final_accuracy(tmp_path):
    table = rounds_to_reach(two_runs(tmp_path), [0.5, 0.9])  # best final 0.8: targets 0.4 and 0.72
    assert table.select("label", "rounds_to_50%", "rounds_to_90%").rows() == [
        ("fed3r", 100, 300), ("fedavg", 300, None), ("fed3r+fedavg", 100, 250),
    ]


def test_the_grid_stays_within_the_shortest_run_and_the_command_prints_both_tables(tmp_path, capsys):
    assert evaluation_grid(two_runs(tmp_path)) == [100, 150, 200, 250]
    main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "accuracy at the same rounds" in out and "rounds_to_90%" in out and "fed3r+fedavg" in out


def test_by_clock_the_second_table_reads_virtual_hours_and_a_run_without_a_clock_is_refused(tmp_path, capsys):
    """Fed3R reaches 0.8 (the best) in an hour; FedAvg 0.4 (its 50%) at 2 h, by the row, not interpolated."""
    for name, method, rows in [("fed3r", "fed3r", [(1, 0.5, 1800.0), (2, 0.8, 3600.0)]),
                               ("fedavg", "fedavg", [(10, 0.2, 3600.0), (20, 0.5, 7200.0)])]:
        (tmp_path / name).mkdir()
        pl.DataFrame([{"method": method, "init": "random", "round": r, "accuracy": a, "clock_s": c,
                       "bytes_up": 1e6 * r, "bytes_down": 0.0} for r, a, c in rows]).write_parquet(
            tmp_path / name / "metrics.parquet")
    main([str(tmp_path), "--by", "clock", "--targets", "0.5", "0.9"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("│")]
    assert "virtual hours to reach a fraction of the best final accuracy" in out
    assert lines[-5:] == ["│ label  ┆ level ┆ target_% ┆ virtual_h ┆ round ┆ upload_MB ┆ download_MB │",
                          "│ fed3r  ┆ 50%   ┆ 40.0     ┆ 0.5       ┆ 1     ┆ 1.0       ┆ 0.0         │",
                          "│ fed3r  ┆ 90%   ┆ 72.0     ┆ 1.0       ┆ 2     ┆ 2.0       ┆ 0.0         │",
                          "│ fedavg ┆ 50%   ┆ 40.0     ┆ 2.0       ┆ 20    ┆ 20.0      ┆ 0.0         │",
                          "│ fedavg ┆ 90%   ┆ 72.0     ┆ null      ┆ null  ┆ null      ┆ null        │"]
    plain = write_run(tmp_path / "plain", "fedncm", "random", [1], [0.3])
    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path), "--by", "clock"])
    assert str(stopped.value) == (f"python -m analysis.convergence: error: {plain}: a run without a clock (no clock_s "
                                  "column) cannot be compared --by clock; compare it --by round, or run it on the "
                                  "clock (--devices, --availability, --deadline)")
