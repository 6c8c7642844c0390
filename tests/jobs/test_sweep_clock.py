"""The clock sweep: every run resolves before any work, and a quick run tables each on phones and diurnal availability,
the deadline the plain FedAvg run's median round, FedBuff and FedAsync beside synchronous FedAvg (FedScale's
comparison) at its concurrency."""

import json

import numpy as np
import polars as pl
import pytest

from jobs import sweep_clock
from jobs.sweep_baselines import check
from jobs.sweep_clock import CONFIGURATIONS, QUICK, chosen, full, run_keywords

LABELS = ["fedncm", "fed3r", "fedcof", "fedavg (LP)", "fed3r+fedavg", "fedavg (deadline, over-commit 1.3)",
          "fednova (deadline, partial)", "fedbuff (LP)", "fedasync (LP)"]
ASYNCHRONOUS = ["fedavg (LP)", "fedbuff (LP)", "fedasync (LP)"]


def test_the_runs_are_the_issues_and_every_one_resolves_without_running():
    assert [c.label for c in CONFIGURATIONS] == LABELS
    for setting in (QUICK, full(128)):
        for configuration in CONFIGURATIONS:
            keywords = run_keywords(configuration, setting, deadline=1.0)
            check(keywords)
            assert (keywords["devices"], keywords["availability"]) == ("phones", "diurnal:86400,0.3")
    by_label = {c.label: run_keywords(c, QUICK, deadline=2.5) for c in CONFIGURATIONS}
    assert by_label["fedavg (deadline, over-commit 1.3)"]["over_commit"] == 1.3
    assert by_label["fedavg (deadline, over-commit 1.3)"]["deadline"] == 2.5
    assert by_label["fednova (deadline, partial)"]["stragglers"] == "partial"
    assert by_label["fednova (deadline, partial)"]["deadline"] == 2.5
    assert by_label["fed3r+fedavg"]["init"] == "fed3r"
    assert all("deadline" not in by_label[label] for label in LABELS[:5] + LABELS[7:])
    assert {label: (by_label[label]["rounds"], by_label[label]["eval_every"]) for label in ASYNCHRONOUS} == {
        "fedavg (LP)": (20, 5), "fedbuff (LP)": (40, 10), "fedasync (LP)": (200, 50)}  # as many updates each
    assert {name: by_label["fedbuff (LP)"][name] for name in ("scheduler", "concurrency", "buffer", "client_lr")} == \
        {"scheduler": "fedbuff", "concurrency": 10, "buffer": 5, "client_lr": 1e-3}
    assert {name: by_label["fedasync (LP)"][name] for name in ("scheduler", "concurrency", "client_lr")} == \
        {"scheduler": "fedasync", "concurrency": 10, "client_lr": 1e-3}
    assert by_label["fedavg (LP)"]["clients_per_round"] == 10
    assert [c.label for c in chosen(True)] == ASYNCHRONOUS and chosen(False) == CONFIGURATIONS


@pytest.mark.slow
def test_a_quick_run_tables_every_run_on_the_clock_and_names_the_first_to_half_the_best(ray_session, tmp_path, capsys):
    sweep_clock.main(["--quick", "--out", str(tmp_path)])
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])

    rounds = pl.read_parquet(tmp_path / "03-fedavg-lp" / "rounds.parquet")
    durations = rounds["end_s"].to_numpy() - rounds["start_s"].to_numpy()
    assert summary["deadline_s"] == round(float(np.median(durations)), 4)

    results = pl.read_parquet(tmp_path / "results.parquet")
    assert results["label"].unique(maintain_order=True).to_list() == LABELS
    assert results["clock_s"].null_count() == 0
    finals = results.group_by("label", maintain_order=True).last()
    deadlines = dict(zip(finals["label"], finals["deadline"]))
    assert deadlines["fedavg (deadline, over-commit 1.3)"] == deadlines["fednova (deadline, partial)"] > 0
    assert all(deadlines[label] is None for label in LABELS[:5] + LABELS[7:])

    best = finals["accuracy"].max()
    assert summary["best_accuracy"] == round(best, 4)
    first_hours = {}
    for (label,), run in results.group_by("label", maintain_order=True):
        reached = run.filter(pl.col("accuracy") >= 0.5 * best)
        first_hours[label] = float(reached["clock_s"][0]) / 3600 if len(reached) else None
    assert list(summary["hours_to_50%"]) == LABELS
    for label, hours in summary["hours_to_50%"].items():
        assert (hours is None) == (first_hours[label] is None)
        if hours is not None:
            assert hours == pytest.approx(first_hours[label], rel=1e-3)  # shown to 4 significant figures
    reached = {label: hours for label, hours in first_hours.items() if hours is not None}
    assert summary["first_to_50%"] == min(reached, key=reached.get)
    assert (tmp_path / "analysis" / "accuracy.png").stat().st_size > 0
    times = pl.read_csv(tmp_path / "analysis" / "time_to_accuracy.csv")
    assert times["label"].unique(maintain_order=True).to_list() == LABELS

    fedscale = summary["asynchronous"]
    folders = {"fedavg (LP)": "03-fedavg-lp", "fedbuff (LP)": "07-fedbuff-lp", "fedasync (LP)": "08-fedasync-lp"}
    steps = {label: pl.read_parquet(tmp_path / folder / "rounds.parquet") for label, folder in folders.items()}
    assert [len(steps[label]) for label in ASYNCHRONOUS] == [20, 40, 200]
    window = min(float(rows["end_s"].max()) for rows in steps.values())
    assert fedscale["window_h"] == pytest.approx(window / 3600, rel=1e-3)
    assert fedscale["server_steps_in_window"] == {label: sum(end <= window for end in rows["end_s"].to_list())
                                                  for label, rows in steps.items()}
    assert list(fedscale["hours_to"]) == ["25%", "50%", "75%", "90%"]
    assert fedscale["hours_to"]["50%"] == {label: summary["hours_to_50%"][label] for label in ASYNCHRONOUS}
    for label in ASYNCHRONOUS[1:]:
        ages = [age for counts in steps[label]["staleness_counts"].to_list() for age, count in enumerate(counts)
                for _ in range(count)]
        assert fedscale["mean_staleness"][label] == round(sum(ages) / len(ages), 3)
