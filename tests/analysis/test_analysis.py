"""Analysis scripts on small result tables built here (values chosen so every number is known)."""

import xml.etree.ElementTree as ElementTree

import polars as pl
import pytest
from PIL import Image

from analysis import convergence, plots, summarize
from analysis.results import read_results, varying_parameters
from fedray.app.cli import main
from fedray.core.errors import FedrayError


def run_rows(trial: str, method: str, kappa: int, seed: int, accuracies: list[float]) -> list[dict]:
    return [
        {"trial_id": trial, "method": method, "clients_per_round": kappa, "seed": seed, "dataset": "d", "lam": 0.01,
         "round": 10 * (i + 1), "accuracy": a, "bytes_up": 1e6 * (i + 1) * kappa, "flops_client_avg": 100.0 + i,
         "clients_seen": (i + 1) * kappa, "samples_seen": 0, "bytes_down": 0.0, "wall_s": 0.1}
        for i, a in enumerate(accuracies)
    ]


@pytest.fixture
def results(tmp_path):
    rows = (
        run_rows("a", "fed3r", 10, 0, [0.40, 0.60, 0.70])
        + run_rows("b", "fed3r", 10, 1, [0.50, 0.60, 0.80])
        + run_rows("c", "fedncm", 10, 0, [0.20, 0.30, 0.35])
        + run_rows("d", "fedncm", 10, 1, [0.10, 0.20, 0.25])
        + run_rows("e", "fed3r", 50, 0, [0.65, 0.75])
    )
    path = tmp_path / "results.parquet"
    pl.DataFrame(rows).write_parquet(path)
    return path


def test_the_swept_axes_are_the_columns_that_vary(results):
    table = read_results([results])
    assert varying_parameters(table) == ["clients_per_round"]
    what_made_them = table.with_columns(pl.col("trial_id").alias("env_started"), pl.col("seed").alias("env_threads"))
    assert varying_parameters(what_made_them) == ["clients_per_round"], "a sweep's env_ columns are not parameters"


def test_a_column_of_one_method_only_varies_only_when_its_values_do(tmp_path):
    """Rows hold the options that apply to their method: Fed3R's ``lam`` is null on FedAvg's rows, FedAvg's
    ``client_lr`` on Fed3R's; FedAvg's runs differ by ``client_lr``, FedNCM and Fed3R by nothing of their own."""
    rows = [{"trial_id": trial, "method": method, "round": 10, "accuracy": 0.5, "lam": lam, "client_lr": lr}
            for trial, method, lam, lr in [("a", "fed3r", 0.01, None), ("b", "fedavg", None, 0.1),
                                           ("c", "fedavg", None, 0.01), ("d", "fedncm", None, None)]]
    path = tmp_path / "results.parquet"
    pl.DataFrame(rows).write_parquet(path)
    assert varying_parameters(read_results([path])) == ["client_lr"]
    ridge = [{"trial_id": "e", "method": "ffc", "round": 10, "accuracy": 0.5, "lam": 0.0, "client_lr": None}]
    pl.DataFrame(rows + ridge).write_parquet(path)
    assert varying_parameters(read_results([path])) == ["lam", "client_lr"]  # two values of lam, across methods


def test_tables_of_runs_with_and_without_a_column_read_as_one(tmp_path):
    """A closed-form run's metrics.parquet and a training run's: the columns one lacks are null in its rows."""
    for name, extra in (("fed3r", {"lam": 0.01}), ("fedavg", {"client_lr": 0.1})):
        (tmp_path / name).mkdir()
        pl.DataFrame([{"method": name, "round": 1, "accuracy": 0.5, **extra}]).write_parquet(tmp_path / name / "metrics.parquet")
    table = read_results([tmp_path])
    assert table.select("method", "lam", "client_lr").rows() == [("fed3r", 0.01, None), ("fedavg", None, 0.1)]


def test_summary_numbers(results):
    table, target = summarize.summarize(read_results([results]), target=0.6)
    rows = {(r["method"], r["clients_per_round"]): r for r in table.iter_rows(named=True)}
    fed3r = rows["fed3r", 10]
    assert fed3r["seeds"] == 2 and fed3r["accuracy_mean"] == pytest.approx(0.75)
    assert fed3r["accuracy_std"] == pytest.approx(0.0707106781, rel=1e-6)
    assert fed3r["rounds_to_target_mean"] == pytest.approx(20.0) and fed3r["upload_bytes_to_target_mean"] == pytest.approx(2e7)
    assert rows["fed3r", 50]["rounds_to_target_mean"] == pytest.approx(10.0)
    assert rows["fedncm", 10]["rounds_to_target_mean"] is None and rows["fedncm", 10]["runs_not_reaching_target"] == 2
    text = summarize.markdown(table, target)
    # the upload per client that took part: 3·10⁷ bytes over 30 clients, 1 MB
    assert fed3r["upload_bytes_per_client"] == pytest.approx(1e6)
    assert "| fed3r | 10 | 2 | 75.00 ± 7.07 | 30 | 30.0 | 1 | 20 ± 0 | 20.0 |" in text
    assert "| fedncm | 10 | 2 | 30.00 ± 7.07 | 30 | 30.0 | 1 | not reached | — |" in text


def test_labelled_runs_are_grouped_per_label_and_dataset_in_the_order_they_come():
    """A job's named configurations: the label says what differs between them (a method, its options), so the rows are
    label × what varies among one label's runs (the dataset), not the options' columns; ordered as the runs came."""
    rows = [{"trial_id": trial, "label": label, "method": method, "dataset": dataset, "covariance": covariance,
             "round": 10, "accuracy": 0.5, "bytes_up": 4e6, "clients_seen": 4}
            for trial, label, method, dataset, covariance in [
                ("i/1", "fedncm", "fedncm", "inat", None), ("i/2", "oracle (diagonal)", "fedcof-oracle", "inat", "diagonal"),
                ("i/3", "oracle (full)", "fedcof-oracle", "inat", "full"), ("c/1", "fedncm", "fedncm", "cifar", None),
                ("c/2", "oracle (diagonal)", "fedcof-oracle", "cifar", "diagonal"),
                ("c/3", "oracle (full)", "fedcof-oracle", "cifar", "full")]]
    table, _ = summarize.summarize(pl.DataFrame(rows))
    assert table.columns[:2] == ["dataset", "label"]
    assert table.select("dataset", "label").rows() == [
        ("inat", "fedncm"), ("inat", "oracle (diagonal)"), ("inat", "oracle (full)"),
        ("cifar", "fedncm"), ("cifar", "oracle (diagonal)"), ("cifar", "oracle (full)")]
    assert table["upload_bytes_per_client"].to_list() == [1e6] * 6


def test_the_default_target_is_reached_by_every_group(results):
    table, target = summarize.summarize(read_results([results]))
    assert target == pytest.approx(0.9 * 0.25)
    assert table["runs_not_reaching_target"].sum() == 0


def test_the_command_writes_csv_and_markdown(results, tmp_path, capsys):
    summarize.main([str(results.parent), "--out", str(tmp_path / "summary"), "--target", "0.6"])
    assert pl.read_csv(tmp_path / "summary" / "summary.csv").height == 3
    assert (tmp_path / "summary" / "summary.md").read_text().startswith("Target accuracy: 60.00%")
    assert "not reached" in capsys.readouterr().out


def test_one_figure_per_axis_in_each_format(results, tmp_path):
    written = plots.plot_all(read_results([results]), tmp_path / "plots")
    assert [p.name for p in written] == ["clients_per_round.png", "clients_per_round.svg"]
    with Image.open(written[0]) as image:
        assert image.format == "PNG" and image.width > 1000
    assert ElementTree.parse(written[1]).getroot().tag == "{http://www.w3.org/2000/svg}svg"


def test_curves_average_the_runs_of_a_line(results):
    data = plots.curves(read_results([results]), "clients_per_round")
    point = data.filter((pl.col("method") == "fed3r") & (pl.col("clients_per_round") == 10) & (pl.col("round") == 10))
    assert (point["mean"].item(), point["low"].item(), point["high"].item()) == pytest.approx((0.45, 0.40, 0.50))


def test_runs_without_a_sweep_are_plotted_as_one_figure(tmp_path):
    path = tmp_path / "run" / "metrics.parquet"
    path.parent.mkdir()
    pl.DataFrame(run_rows("x", "fed3r", 10, 0, [0.1, 0.2])).drop("trial_id").write_parquet(path)
    assert [p.name for p in plots.plot_all(read_results([tmp_path]), tmp_path / "plots", ("png",))] == ["runs.png"]


def test_runs_on_the_clock_get_a_panel_of_virtual_hours_averaged_over_seeds(results, tmp_path):
    """Runs a and b (Fed3R, κ = 10, two seeds) on the clock: at round 10, 1 and 2 hours; the others have no clock."""
    table = read_results([results]).with_columns(
        pl.when(pl.col("trial_id") == "a").then(pl.col("round") * 360.0)
        .when(pl.col("trial_id") == "b").then(pl.col("round") * 720.0).alias("clock_s"))
    assert [panel[0] for panel in plots.panels_of(table)] == ["round", "bytes_up", "flops_client_avg", "clock_h"]
    data = plots.curves(table, "clients_per_round")
    line = data.filter((pl.col("method") == "fed3r") & (pl.col("clients_per_round") == 10))
    assert line["clock_h"].to_list() == [1.5, 3.0, 4.5]
    assert data.filter(pl.col("method") == "fedncm")["clock_h"].to_list() == [None, None, None]
    figure = plots.figure(table, "clients_per_round")
    assert [axes.get_xlabel() for axes in figure.axes][-1] == "virtual time (hours)"
    written = plots.plot_all(table, tmp_path / "plots", ("png",))
    with Image.open(written[0]) as image:
        assert image.width == 4 * 5 * 120  # four panels of 5 inches at 120 dpi
    assert len(plots.panels_of(read_results([results]))) == 3


def test_the_clocks_columns_are_results_not_swept_parameters():
    """Two trials of a deadline sweep: their clocks and stragglers differ because their deadlines do."""
    table = pl.DataFrame({"trial_id": ["a", "b"], "method": ["fedavg"] * 2, "round": [1, 1], "accuracy": [0.5, 0.5],
                          "deadline": [60, 120], "clock_s": [600.0, 1200.0], "clock_compute_s": [500.0, 1000.0],
                          "clock_comm_s": [100.0, 200.0], "clients_straggled": [2, 1], "clients_dropped": [1, 0]})
    assert varying_parameters(table) == ["deadline"]


def test_missing_inputs_are_named(tmp_path):
    with pytest.raises(FedrayError, match="no such file"):
        read_results([tmp_path / "nothing"])
    with pytest.raises(FedrayError, match="no results.parquet or metrics.parquet"):
        read_results([tmp_path])


def test_fedray_summarize_prints_the_table_and_writes_files_only_with_out(results, capsys):
    assert main(["summarize", str(results), "--target", "0.6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Target accuracy: 60.00%")
    assert "| fed3r | 10 | 2 | 75.00 ± 7.07 | 30 | 30.0 | 1 | 20 ± 0 |" in out
    assert [path.name for path in results.parent.iterdir()] == ["results.parquet"]


@pytest.mark.parametrize("args, message", [
    (["--target", "60"], "--target must be an accuracy in [0, 1], got 60.0"),
    (["--out", "{results}"], "--out {results}: is a file, not a folder"),
])
def test_bad_summarize_options_are_one_line_before_any_work(results, capsys, args, message):
    args = [arg.format(results=results) for arg in args]
    assert main(["summarize", str(results), *args]) == 2
    assert capsys.readouterr() == ("", f"fedray: error: {message.format(results=results)}\n")


@pytest.mark.parametrize("script, args", [(summarize, ["--out", "summary"]), (plots, ["--out", "plots"]),
                                          (convergence, [])], ids=["summarize", "plots", "convergence"])
def test_a_script_given_a_bad_path_ends_in_one_line_naming_it(tmp_path, script, args):
    with pytest.raises(SystemExit) as stopped:
        script.main([str(tmp_path / "nothing"), *[str(tmp_path / arg) if arg != "--out" else arg for arg in args]])
    assert str(stopped.value) == f"python -m {script.__name__}: error: {tmp_path / 'nothing'}: no such file or folder"
