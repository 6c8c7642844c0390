"""The privacy sweep: its grid (every method × ε, FedAvg-LP through dp-fedavg where registered) resolves before any work,
and a quick run's ε = ∞ rows are its plain runs' accuracies exactly, every row spends at most the ε asked, and a method
the DP postprocessor refuses is skipped after one refusal, its plain row kept."""

import json
import math

import numpy as np
import polars as pl
import pytest

from fedray.data.registry import load_federation
from fedray.methods import postprocessor as postprocessor_module
from jobs import sweep_privacy
from jobs.sweep_baselines import QUICK, check, run_keywords
from jobs.sweep_privacy import EPSILONS, configurations, default_methods

TINY = "synthetic:inat-user-120k?dim=8&scale=0.01&classes=20"


@pytest.fixture
def dp_fedavg_registered(monkeypatch):
    """dp-fedavg (built on another branch) stood in for by a postprocessor with its options."""
    monkeypatch.setitem(postprocessor_module.BUILT_IN, "dp-fedavg", "tests.engine.test_dp_options:TrainingDp")


def test_the_grid_is_every_method_at_every_epsilon_and_resolves(dp_fedavg_registered):
    methods, note = default_methods()
    assert methods == ["fedncm", "fed3r", "fedcof", "fedavg"] and note is None
    grid = configurations(methods, list(EPSILONS), clip=20.5, delta=1e-6)
    assert len({c.label for c in grid}) == len(grid) == 4 * 7
    for method in methods:
        runs = [c for c in grid if c.method == method]
        assert [c.run_options.get("dp_epsilon") for c in runs] == [None, None, 0.5, 1.0, 2.0, 4.0, 8.0]
        assert [c.run_options.get("dp_noise") for c in runs] == [None, 0.0, None, None, None, None, None]
        assert {c.run_options.get("clip_norm") for c in runs[1:]} == {1.0 if method == "fedavg" else 20.5}
        assert all(c.run_options["dp_delta"] == 1e-6 for c in runs[1:]) and "dp_delta" not in runs[0].run_options
        assert [c.after for c in runs] == [None, None] + [f"{method}, ε = inf"] * 5
        for configuration in runs:
            check(run_keywords(configuration, QUICK[0], True))


def test_fedavg_is_left_out_by_default_saying_why_until_dp_fedavg_is_registered(monkeypatch):
    monkeypatch.delitem(postprocessor_module.BUILT_IN, "dp-fedavg", raising=False)
    methods, note = default_methods()
    assert methods == ["fedncm", "fed3r", "fedcof"]
    assert note.startswith("fedavg (FedAvg-LP) left out: the dp-fedavg postprocessor (DP-FedAvg) is not registered")


@pytest.mark.slow
def test_a_quick_run_is_the_plain_run_at_infinite_epsilon_and_spends_at_most_each_epsilon(ray_session, tmp_path, capsys):
    sweep_privacy.main(["--quick", "--dataset", TINY, "--methods", "fedncm,fed3r,fedcof", "--epsilons", "2,inf",
                        "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    summary = json.loads(printed.strip().splitlines()[-1])
    federation = load_federation(TINY)
    ids, _, _ = federation.train_arrays(0, federation.num_clients)
    features = federation.source.features("train", ids).numpy().astype(np.float64)
    largest = np.sqrt((features**2).sum(axis=1)).max()
    assert largest <= summary["clip_norm"] <= largest * 1.01 and summary["dp_delta"] == 1e-5 < 1 / len(ids)

    table = pl.read_csv(tmp_path / "analysis" / "privacy.csv")
    assert table.columns == ["method", "no DP", "2", "∞"] and table["method"].to_list() == ["fedncm", "fed3r", "fedcof"]
    assert (tmp_path / "analysis" / "accuracy_vs_epsilon.png").stat().st_size > 0
    rows = pl.read_parquet(tmp_path / "results.parquet")
    finals = {(row["method"], row["target_epsilon"]): row for row in rows.iter_rows(named=True)}  # one evaluation a run
    assert len(finals) == rows.height
    for method in ["fedncm", "fed3r", "fedcof"]:
        plain, infinite, noisy = finals[method, None], finals[method, math.inf], finals[method, 2.0]
        assert infinite["accuracy"] == plain["accuracy"] and infinite["dp_epsilon"] == math.inf
        assert 0 < noisy["dp_epsilon"] <= 2.0 and noisy["dp_delta"] == 1e-5 and noisy["clip_norm"] == summary["clip_norm"]
        assert summary["infinite_equals_plain"][method] is True
    assert finals["fedcof", 2.0]["dp_placement"] == "distributed" and summary["skipped"] == []
