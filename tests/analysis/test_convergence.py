"""analysis.convergence on metrics tables with known evaluation points."""

import polars as pl

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
