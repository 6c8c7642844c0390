"""``fedray compare`` and ``python -m analysis.compare`` (one implementation) on small run and sweep folders written
here, every number in them chosen."""

import xml.etree.ElementTree as ElementTree
from pathlib import Path

import polars as pl
import pytest
from PIL import Image

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


def write_clock_run(folder: Path, method: str, rows: list[tuple], **options) -> Path:
    """A run on the clock: rows of (round, accuracy, clock_s, clock_compute_s, clock_comm_s, bytes_up, stragglers,
    dropped), stragglers and dropped None where they do not apply (then absent from its table)."""
    folder.mkdir(parents=True)
    names = ("round", "accuracy", "clock_s", "clock_compute_s", "clock_comm_s", "bytes_up", "clients_straggled", "clients_dropped")
    table = pl.DataFrame([{"method": method, "dataset": "inat", "seed": 0, "clients_seen": 10 * row[0],
                           "samples_seen": 0, "bytes_down": row[5] / 2, "wall_s": 9.0, **dict(zip(names, row)),
                           **options} for row in rows])
    table.drop([name for name in ("clients_straggled", "clients_dropped") if table[name].is_null().all()]).write_parquet(
        folder / "metrics.parquet")
    return folder


@pytest.fixture
def clocked(tmp_path) -> list[Path]:
    """Fed3R: 65% after half an hour, 80% after one. FedAvg with a deadline: 10% an hour, 70% after four."""
    return [write_clock_run(tmp_path / "fed3r", "fed3r", [(1, 0.65, 1800.0, 600.0, 1200.0, 100e6, None, None),
                                                          (2, 0.80, 3600.0, 1200.0, 2400.0, 200e6, None, None)]),
            write_clock_run(tmp_path / "fedavg", "fedavg", [(10, 0.1, 3600.0, 3000.0, 600.0, 1e6, 1, 0),
                                                            (20, 0.3, 7200.0, 6000.0, 1200.0, 2e6, 3, 1),
                                                            (30, 0.5, 10800.0, 9000.0, 1800.0, 3e6, 4, 1),
                                                            (40, 0.7, 14400.0, 12000.0, 2400.0, 4e6, 6, 2)])]


def test_compare_by_clock_puts_the_runs_on_virtual_hours_and_reads_the_hours_to_each_level(clocked, capsys):
    rc, out, err = fedray(capsys, "compare", "--by", "clock", *clocked)
    assert (rc, err) == (0, "")
    assert out.splitlines()[0] == "runs on the virtual clock: the last evaluation point of each"
    assert ("virtual hours to a fraction of the best final accuracy over these runs (80.00%): each run's first "
            "evaluation at or above it") in out.splitlines()
    assert table_lines(out) == [
        "│ method ┆ dataset ┆ accuracy_% ┆ rounds ┆ clients_seen ┆ upload_MB ┆ virtual_h ┆ compute_h ┆ comm_h ┆ "
        "stragglers ┆ dropped │",
        "│ fed3r  ┆ inat    ┆ 80.0       ┆ 2      ┆ 20           ┆ 200.0     ┆ 1.0       ┆ 0.3333    ┆ 0.6667 ┆ "
        "null       ┆ null    │",
        "│ fedavg ┆ inat    ┆ 70.0       ┆ 40     ┆ 400          ┆ 4.0       ┆ 4.0       ┆ 3.333     ┆ 0.6667 ┆ "
        "6          ┆ 2       │",
        "│ method ┆ level ┆ target_% ┆ virtual_h ┆ round ┆ upload_MB ┆ download_MB ┆ stragglers ┆ dropped │",
        "│ fed3r  ┆ 25%   ┆ 20.0     ┆ 0.5       ┆ 1     ┆ 100.0     ┆ 50.0        ┆ null       ┆ null    │",
        "│ fed3r  ┆ 50%   ┆ 40.0     ┆ 0.5       ┆ 1     ┆ 100.0     ┆ 50.0        ┆ null       ┆ null    │",
        "│ fed3r  ┆ 75%   ┆ 60.0     ┆ 0.5       ┆ 1     ┆ 100.0     ┆ 50.0        ┆ null       ┆ null    │",
        "│ fed3r  ┆ 90%   ┆ 72.0     ┆ 1.0       ┆ 2     ┆ 200.0     ┆ 100.0       ┆ null       ┆ null    │",
        "│ fedavg ┆ 25%   ┆ 20.0     ┆ 2.0       ┆ 20    ┆ 2.0       ┆ 1.0         ┆ 3          ┆ 1       │",
        "│ fedavg ┆ 50%   ┆ 40.0     ┆ 3.0       ┆ 30    ┆ 3.0       ┆ 1.5         ┆ 4          ┆ 1       │",
        "│ fedavg ┆ 75%   ┆ 60.0     ┆ 4.0       ┆ 40    ┆ 4.0       ┆ 2.0         ┆ 6          ┆ 2       │",
        "│ fedavg ┆ 90%   ┆ 72.0     ┆ null      ┆ null  ┆ null      ┆ null        ┆ null       ┆ null    │",
    ]


def test_compare_by_round_is_unchanged_for_runs_on_the_clock(clocked, capsys):
    rc, out, err = fedray(capsys, "compare", *clocked)
    assert (rc, err) == (0, "")
    assert table_lines(out) == [
        "│ method ┆ dataset ┆ accuracy_% ┆ rounds ┆ clients_seen ┆ upload_MB ┆ wall_s │",
        "│ fed3r  ┆ inat    ┆ 80.0       ┆ 2      ┆ 20           ┆ 200.0     ┆ 9.0    │",
        "│ fedavg ┆ inat    ┆ 70.0       ┆ 40     ┆ 400          ┆ 4.0       ┆ 9.0    │",
    ]


def test_a_swept_deadline_tells_the_runs_apart_and_the_clocks_columns_are_not_parameters(tmp_path, capsys):
    """The runs' clocks and stragglers differ too, as a sweep's do: they are results, not the sweep's axes."""
    runs = [write_clock_run(tmp_path / f"d{deadline}", "fedavg",
                            [(10, 0.5, 10.0 * deadline, 8.0 * deadline, 2.0 * deadline, 1e6, 120 // deadline, 0),
                             (20, 0.6, 20.0 * deadline, 16.0 * deadline, 4.0 * deadline, 2e6, 240 // deadline, 0)],
                            deadline=deadline) for deadline in (60, 120)]
    rc, out, err = fedray(capsys, "compare", "--by", "clock", *runs)
    assert (rc, err) == (0, "")
    assert [line.split(" ┆ ")[:3] for line in table_lines(out)] == [
        ["│ method", "dataset", "deadline"], ["│ fedavg", "inat   ", "60      "], ["│ fedavg", "inat   ", "120     "],
        ["│ method", "deadline", "level"], *[["│ fedavg", f"{deadline:<8}", f"{level:<5}"] for deadline in (60, 120)
                                             for level in ("25%", "50%", "75%", "90%")]]


def test_an_asynchronous_run_beside_a_synchronous_one_differs_by_its_scheduler_not_by_its_staleness(tmp_path, capsys):
    """FedBuff's rows carry its server steps and staleness: results, not the runs' parameters."""
    rows = [(10, 0.5, 100.0, 80.0, 20.0, 1e6, 0, 0), (20, 0.6, 200.0, 160.0, 40.0, 2e6, 0, 0)]
    runs = [write_clock_run(tmp_path / "sync", "fedavg", rows, scheduler="sync"),
            write_clock_run(tmp_path / "fedbuff", "fedavg", rows, scheduler="fedbuff", aggregations=20,
                            staleness_mean=1.25, staleness_max=3)]
    rc, out, err = fedray(capsys, "compare", "--by", "clock", *runs)
    assert (rc, err) == (0, "")
    assert [line.split(" ┆ ")[:4] for line in table_lines(out)][:3] == [
        ["│ method", "dataset", "scheduler", "accuracy_%"], ["│ fedavg", "inat   ", "sync     ", "60.0      "],
        ["│ fedavg", "inat   ", "fedbuff  ", "60.0      "]]


def test_compare_by_clock_refuses_a_run_without_a_clock_in_one_line_naming_it(clocked, quickstart, capsys):
    rc, out, err = fedray(capsys, "compare", "--by", "clock", *clocked, quickstart / "fed3r")
    assert (rc, out) == (2, "")
    assert err == (f"fedray: error: {quickstart / 'fed3r'}: a run without a clock (no clock_s column) cannot be "
                   "compared --by clock; compare it --by round, or run it on the clock (--devices, --availability, "
                   "--deadline)\n")


def test_plot_draws_accuracy_against_virtual_hours(clocked, tmp_path, capsys):
    plot = tmp_path / "plots" / "clock.png"
    rc, out, err = fedray(capsys, "compare", "--by", "clock", *clocked, "--plot", plot)
    assert (rc, err, out.splitlines()[-1]) == (0, "", str(plot))
    with Image.open(plot) as image:
        assert image.format == "PNG" and image.width > 600
    points = compare.curve_points(compare.read_compared([str(run) for run in clocked], "clock"))
    assert points.select("label", "virtual_h", "accuracy_%").rows() == [
        ("fed3r", 0.5, 65.0), ("fed3r", 1.0, 80.0), ("fedavg", 1.0, 10.0), ("fedavg", 2.0, 30.0), ("fedavg", 3.0, 50.0),
        ("fedavg", 4.0, 70.0)]


def test_plot_by_round_draws_accuracy_against_rounds_for_runs_without_a_clock(quickstart, tmp_path, capsys):
    plot = tmp_path / "rounds.svg"
    rc, out, err = fedray(capsys, "compare", quickstart, "--plot", plot)
    assert (rc, err, out.splitlines()[-1]) == (0, "", str(plot))
    assert ElementTree.parse(plot).getroot().tag == "{http://www.w3.org/2000/svg}svg"
    points = compare.curve_points(compare.read_compared([str(quickstart)]))
    assert points.columns == ["trial_id", "label", "round", "accuracy_%"]
    assert points.select("label", "round").rows() == [("fed3r", 900), ("fed3r", 928), ("fedcof", 900), ("fedcof", 928),
                                                      ("fedncm", 900), ("fedncm", 928)]


@pytest.mark.parametrize("plot, message", [("clock.txt", "--plot {plot}: name a .png, .svg or .pdf file"),
                                           ("folder.png", "--plot {plot}: is a folder; name the file to write, e.g. "
                                                          "{plot}/accuracy.png")])
def test_a_bad_plot_file_is_refused_before_any_work(clocked, tmp_path, capsys, plot, message):
    (tmp_path / "folder.png").mkdir()
    plot = tmp_path / plot
    rc, out, err = fedray(capsys, "compare", "--by", "clock", *clocked, "--plot", plot)
    assert (rc, out, err) == (2, "", f"fedray: error: {message.format(plot=plot)}\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fed3r", "fedavg", "folder.png"]
