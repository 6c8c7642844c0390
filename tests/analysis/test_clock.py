"""analysis.clock on hand-written tables of runs on the virtual clock, every number in them chosen.

Time to accuracy: the targets are fractions of the best final accuracy over the runs (0.8 here: 0.2, 0.4, 0.6, 0.72),
and a run reaches one at its first evaluation row at or above it, that row's clock as it is (no interpolation).
"""

import polars as pl
import pytest

from analysis.clock import check_clock, clock_columns, time_to_accuracy
from fedray.core.errors import FedrayError

COLUMNS = ("round", "accuracy", "clock_s", "clock_compute_s", "clock_comm_s", "bytes_up", "bytes_down", "clients_straggled",
           "clients_dropped")


def run(trial: str, method: str, rows: list[tuple]) -> pl.DataFrame:
    """A run's rows: (round, accuracy, clock_s, clock_compute_s, clock_comm_s, bytes_up, bytes_down, stragglers,
    dropped) each; stragglers and dropped None where they do not apply."""
    return pl.DataFrame([dict(zip(COLUMNS, row)) for row in rows], orient="row").with_columns(
        trial_id=pl.lit(trial), method=pl.lit(method))


@pytest.fixture
def runs() -> pl.DataFrame:
    fed3r = run("a", "fed3r", [(1, 0.65, 1800.0, 600.0, 1200.0, 100e6, 0.0, None, None),
                               (2, 0.80, 3600.0, 1200.0, 2400.0, 200e6, 0.0, None, None)])
    fedavg = run("b", "fedavg", [(10, 0.1, 3600.0, 3000.0, 600.0, 1e6, 1e6, 1, 0),
                                 (20, 0.3, 7200.0, 6000.0, 1200.0, 2e6, 2e6, 3, 1),
                                 (30, 0.5, 10800.0, 9000.0, 1800.0, 3e6, 3e6, 4, 1),
                                 (40, 0.7, 14400.0, 12000.0, 2400.0, 4e6, 4e6, 6, 2)])
    fedncm = run("c", "fedncm", [(1, 0.3, 30.0, 6.0, 24.0, 5e6, 0.0, None, None)])
    return pl.concat([fed3r, fedavg, fedncm], how="diagonal_relaxed")


def test_the_hours_to_each_level_are_the_first_row_at_or_above_it_with_its_bytes_and_stragglers(runs):
    table = time_to_accuracy(runs, ["method"])
    assert table.columns == ["method", "level", "target_%", "virtual_h", "round", "upload_MB", "download_MB",
                             "stragglers", "dropped"]
    assert table.rows() == [
        ("fed3r", "25%", 20.0, 0.5, 1, 100.0, 0.0, None, None),
        ("fed3r", "50%", 40.0, 0.5, 1, 100.0, 0.0, None, None),
        ("fed3r", "75%", 60.0, 0.5, 1, 100.0, 0.0, None, None),
        ("fed3r", "90%", 72.0, 1.0, 2, 200.0, 0.0, None, None),
        ("fedavg", "25%", 20.0, 2.0, 20, 2.0, 2.0, 3, 1),  # 0.1 < 0.2 ≤ 0.3: the row at 2 h, not 1.5 h between them
        ("fedavg", "50%", 40.0, 3.0, 30, 3.0, 3.0, 4, 1),
        ("fedavg", "75%", 60.0, 4.0, 40, 4.0, 4.0, 6, 2),
        ("fedavg", "90%", 72.0, None, None, None, None, None, None),  # 0.7 < 0.72: never
        ("fedncm", "25%", 20.0, 0.008333, 1, 5.0, 0.0, None, None),  # 30 s, to 4 significant figures
        ("fedncm", "50%", 40.0, None, None, None, None, None, None),
        ("fedncm", "75%", 60.0, None, None, None, None, None, None),
        ("fedncm", "90%", 72.0, None, None, None, None, None, None),
    ]
    assert "download_MB" not in time_to_accuracy(runs.drop("bytes_down"), ["method"]).columns  # a table without it


def test_a_row_exactly_at_the_target_reaches_it(runs):
    """The best final accuracy is 0.8, 50% of it 0.4: fedavg's row at 0.4 reaches it, not the next one."""
    fedavg_at_03 = (pl.col("trial_id") == "b") & (pl.col("accuracy") == 0.3)
    at_target = runs.with_columns(pl.when(fedavg_at_03).then(0.4).otherwise("accuracy").alias("accuracy"))
    table = time_to_accuracy(at_target, ["method"], levels=(0.5,))
    assert table.select("method", "virtual_h", "round").rows() == [("fed3r", 0.5, 1), ("fedavg", 2.0, 20),
                                                                    ("fedncm", None, None)]


def test_the_place_on_the_clock_is_in_hours_with_the_counts_where_runs_have_them(runs):
    finals = runs.group_by("trial_id", maintain_order=True).last()
    assert finals.select(clock_columns(finals)).rows() == [(1.0, 0.3333, 0.6667, None, None),
                                                           (4.0, 3.333, 0.6667, 6, 2),
                                                           (0.008333, 0.001667, 0.006667, None, None)]
    without_counts = finals.drop("clients_straggled", "clients_dropped", "clock_compute_s", "clock_comm_s")
    assert without_counts.select(clock_columns(without_counts)).columns == ["virtual_h"]


def test_a_run_without_a_clock_is_refused_naming_it(runs):
    check_clock(runs)
    plain = pl.DataFrame({"trial_id": ["results/fedavg"], "method": ["fedavg"], "round": [1], "accuracy": [0.5]})
    with pytest.raises(FedrayError) as refused:
        check_clock(pl.concat([runs, plain], how="diagonal_relaxed"))
    assert str(refused.value) == ("results/fedavg: a run without a clock (no clock_s column) cannot be compared --by "
                                  "clock; compare it --by round, or run it on the clock (--devices, --availability, "
                                  "--deadline)")
    with pytest.raises(FedrayError, match=r"^results/fedavg \(and 1 more\): a run without a clock"):
        check_clock(pl.concat([plain, plain.with_columns(trial_id=pl.lit("other"))]))
    sweep = pl.concat([runs, plain.with_columns(trial_id=pl.lit("t2"))], how="diagonal_relaxed")
    with pytest.raises(FedrayError, match=r"^trial t2 of sweep deadline: a run without a clock"):
        check_clock(sweep.with_columns(sweep=pl.lit("deadline")))
