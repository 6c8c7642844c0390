"""``fedray compare`` and ``python -m analysis.compare`` (one implementation) on small run and sweep folders written
here, every number in them chosen."""

from pathlib import Path

import polars as pl
import pytest

from analysis import compare
from fedray.app.cli import main

DATASET = "synthetic:inat-user-120k?dim=8"
HEADER = "│ method ┆ dataset                        ┆ accuracy_% ┆ rounds ┆ clients_seen ┆ upload_MB ┆ wall_s │"
QUICKSTART_ROWS = [
    "│ fedncm ┆ synthetic:inat-user-120k?dim=8 ┆ 30.72      ┆ 928    ┆ 9275         ┆ 279.4     ┆ 7.3    │",
    "│ fed3r  ┆ synthetic:inat-user-120k?dim=8 ┆ 77.64      ┆ 928    ┆ 9275         ┆ 61064.1   ┆ 12.6   │",
    "│ fedcof ┆ synthetic:inat-user-120k?dim=8 ┆ 72.99      ┆ 928    ┆ 9275         ┆ 279.4     ┆ 20.4   │",
]


def write_run(folder: Path, method: str, accuracy: float, bytes_up: float, wall_s: float, **options) -> Path:
    """A run's folder as ``fedray run`` leaves it (metrics.parquet with two evaluation points, a config beside it)."""
    folder.mkdir(parents=True)
    rows = [{"method": method, "dataset": DATASET, "seed": 0, "out": str(folder), "round": r, "accuracy": a,
             "clients_seen": seen, "samples_seen": 12 * seen, "bytes_up": b, "wall_s": w, "stage": "closed_form",
             **options}
            for r, a, seen, b, w in [(900, accuracy - 0.1, 9000, bytes_up / 2, wall_s / 2),
                                     (928, accuracy, 9275, bytes_up, wall_s)]]
    pl.DataFrame(rows).write_parquet(folder / "metrics.parquet")
    (folder / "config.yaml").write_text(f"method: {method}\n")
    return folder


@pytest.fixture
def quickstart(tmp_path):
    """``results/quickstart/<method>/`` as the quickstart writes it."""
    root = tmp_path / "results" / "quickstart"
    write_run(root / "fedncm", "fedncm", 0.3072, 279.4e6, 7.31, distance="cosine")
    write_run(root / "fed3r", "fed3r", 0.7764, 61064.1e6, 12.6, lam=0.01)
    write_run(root / "fedcof", "fedcof", 0.7299, 279.4e6, 20.4, gamma=0.1)
    return root


def table_lines(out: str) -> list[str]:
    """The header and rows of a printed table (its borders left out)."""
    return [line for line in out.splitlines() if line.startswith("│")]


def fedray(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_compare_prints_the_quickstarts_runs_side_by_side_in_the_order_given(quickstart, capsys):
    rc, out, err = fedray(capsys, "compare", *(quickstart / method for method in ("fedncm", "fed3r", "fedcof")))
    assert (rc, err) == (0, "")
    assert table_lines(out) == [HEADER, *QUICKSTART_ROWS]


def test_compare_takes_metrics_files_and_a_folder_of_runs(quickstart, capsys):
    files = [quickstart / method / "metrics.parquet" for method in ("fedncm", "fed3r", "fedcof")]
    assert table_lines(fedray(capsys, "compare", *files)[1]) == [HEADER, *QUICKSTART_ROWS]
    by_name = [QUICKSTART_ROWS[i] for i in (1, 2, 0)]  # fed3r, fedcof, fedncm: the folder's runs by name
    assert table_lines(fedray(capsys, "compare", quickstart)[1]) == [HEADER, *by_name]


def test_a_sweep_is_a_row_per_trial_with_what_varies_and_its_trials_folders_are_not_counted_twice(tmp_path, capsys):
    sweep = tmp_path / "sweeps" / "kappa"
    trials = [write_run(sweep / f"t{kappa}", "fed3r", 0.5 + kappa / 100, 1e6 * kappa, 1.0, clients_per_round=kappa,
                        lam=0.01) for kappa in (10, 20)]
    table = pl.concat([pl.read_parquet(trial / "metrics.parquet").with_columns(trial_id=pl.lit(trial.name),
                                                                              sweep=pl.lit("kappa"))
                       for trial in trials])
    table.write_parquet(sweep / "results.parquet")
    run = write_run(tmp_path / "runs" / "alone", "fedncm", 0.25, 2e6, 3.0, distance="cosine")
    rc, out, err = fedray(capsys, "compare", sweep, run)
    assert (rc, err) == (0, "")
    assert table_lines(out) == [
        "│ method ┆ dataset                        ┆ clients_per_round ┆ accuracy_% ┆ rounds ┆ clients_seen "
        "┆ upload_MB ┆ wall_s │",
        "│ fed3r  ┆ synthetic:inat-user-120k?dim=8 ┆ 10                ┆ 60.0       ┆ 928    ┆ 9275         "
        "┆ 10.0      ┆ 1.0    │",
        "│ fed3r  ┆ synthetic:inat-user-120k?dim=8 ┆ 20                ┆ 70.0       ┆ 928    ┆ 9275         "
        "┆ 20.0      ┆ 1.0    │",
        "│ fedncm ┆ synthetic:inat-user-120k?dim=8 ┆ null              ┆ 25.0       ┆ 928    ┆ 9275         "
        "┆ 2.0       ┆ 3.0    │",
    ]
    rows = table_lines(out)[1:]
    assert table_lines(fedray(capsys, "compare", tmp_path)[1])[1:] == [rows[2], *rows[:2]]  # runs/ before sweeps/


def test_runs_of_another_round_budget_show_the_rounds_they_ran_once(tmp_path, capsys):
    short = write_run(tmp_path / "short", "fed3r", 0.5, 1e6, 1.0, rounds=20)
    long = write_run(tmp_path / "long", "fed3r", 0.6, 2e6, 2.0, rounds=928)
    rc, out, err = fedray(capsys, "compare", short, long)
    assert (rc, err) == (0, "")
    assert table_lines(out) == [
        HEADER,
        "│ fed3r  ┆ synthetic:inat-user-120k?dim=8 ┆ 50.0       ┆ 928    ┆ 9275         ┆ 1.0       ┆ 1.0    │",
        "│ fed3r  ┆ synthetic:inat-user-120k?dim=8 ┆ 60.0       ┆ 928    ┆ 9275         ┆ 2.0       ┆ 2.0    │",
    ]


def test_the_script_prints_the_same_table(quickstart, capsys):
    compare.main([str(quickstart / method) for method in ("fedncm", "fed3r", "fedcof")])
    assert table_lines(capsys.readouterr().out) == [HEADER, *QUICKSTART_ROWS]


@pytest.mark.parametrize("entry", [lambda args: main(["compare", *args]), compare.main])
def test_help_says_what_a_run_may_be(entry, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as stopped:
        entry(["--help"])
    out, err = capsys.readouterr()
    assert (stopped.value.code, err) == (0, "")
    assert "RUN [RUN ...]" in out and "a run's folder or metrics.parquet, a sweep's folder or results.parquet" in out


def bad_inputs(tmp_path: Path) -> list[tuple[Path, str]]:
    missing = tmp_path / "nope"
    empty = tmp_path / "empty"
    empty.mkdir()
    text = tmp_path / "notes.parquet"
    text.write_text("not a table")
    features = tmp_path / "features.parquet"
    pl.DataFrame({"client_id": [0], "label": [1]}).write_parquet(features)
    return [(missing, f"{missing}: no such file or folder"),
            (empty, f"{empty}: no results.parquet or metrics.parquet under this folder"),
            (text, f"{text}: not a Parquet table (parquet: File out of specification: "),
            (features, f"{features}: no method, dataset, round, accuracy, clients_seen, bytes_up, wall_s columns: "
                       "not a run's metrics.parquet or a sweep's results.parquet")]


def test_a_bad_path_is_one_line_naming_it(quickstart, tmp_path, capsys):
    for path, message in bad_inputs(tmp_path):
        rc, out, err = fedray(capsys, "compare", quickstart / "fed3r", path)
        assert (rc, out) == (2, "") and err.startswith(f"fedray: error: {message}") and err.count("\n") == 1, err
        with pytest.raises(SystemExit) as stopped:
            compare.main([str(quickstart / "fed3r"), str(path)])
        assert str(stopped.value).startswith(f"python -m analysis.compare: error: {message}")
        assert "\n" not in str(stopped.value)
