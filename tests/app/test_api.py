"""``fedray.run`` and ``fedray.sweep`` from Python: the run's result as objects, each evaluation point's classifier,
the rounds' clients; a sweep's table."""

import json

import numpy as np
import polars as pl
import pytest
import torch

import fedray
from fedray.core.results import POINT_COLUMNS
from fedray.runtime.provenance import FIELDS

SPEC = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"
SMALL_RUN = {"num_shards": 2, "cpus_per_shard": 0.5, "quiet": True}
EVALUATION_COLUMNS = list(POINT_COLUMNS)


def class_means(clients: np.ndarray) -> np.ndarray:
    """FedNCM's classifier from ``clients``' samples, written out: each class's mean feature (d × C), unit columns,
    zero for a class none of them holds."""
    federation = fedray.load_federation(SPEC)
    features, labels = [], []
    for client in clients.tolist():
        sample_ids, client_labels, _ = federation.train_arrays(client, client + 1)
        features.append(federation.source.features("train", sample_ids).double().numpy())
        labels.append(client_labels)
    features, labels = np.concatenate(features), np.concatenate(labels)
    means = np.zeros((federation.dim, federation.num_classes))
    for c in np.unique(labels):
        mean = features[labels == c].mean(0)
        means[:, c] = mean / np.linalg.norm(mean)
    return means


def test_a_closed_form_run_returns_its_files_its_rounds_and_each_points_classifier(ray_session, tmp_path):
    heard = []
    result = fedray.run(method="fedncm", dataset=SPEC, out=tmp_path, eval_every=8, **SMALL_RUN,
                        on_evaluation=lambda row, classifier: heard.append((row, classifier)))
    assert isinstance(result, fedray.RunResult) and result.out == tmp_path
    assert result.metrics.equals(pl.read_parquet(tmp_path / "metrics.parquet"))
    with np.load(tmp_path / "classifier.npz") as saved:
        assert saved.files == ["W"] and np.array_equal(result.classifier.weight.numpy(), saved["W"])
    assert result.classifier.bias is None and result.arrays == {}
    assert json.loads((tmp_path / "run.json").read_text())["command"] == "fedray.run"  # the API call, not python's argv
    # 186 clients, 10 a round without replacement: 19 rounds, every client once, evaluated after rounds 8, 16 and 19
    assert len(result.rounds) == 19 and [len(clients) for clients in result.rounds] == [10] * 18 + [6]
    assert np.array_equal(np.sort(np.concatenate(result.rounds)), np.arange(186))
    assert [row for row, _ in heard] == result.metrics.select(EVALUATION_COLUMNS).to_dicts()
    assert [row["round"] for row, _ in heard] == [8, 16, 19]
    for row, classifier in heard:  # the classifier solved from the clients seen by then
        expected = class_means(np.concatenate(result.rounds[:row["round"]]))
        assert np.abs(classifier.weight.numpy() - expected).max() <= 1e-12
    assert torch.equal(heard[-1][1].weight, result.classifier.weight)


def test_a_training_run_reports_its_head_at_each_point(ray_session, tmp_path):
    heard = []
    result = fedray.run(method="fedavg", dataset=SPEC, out=tmp_path, rounds=4, eval_every=2, client_lr=0.05, **SMALL_RUN,
                        on_evaluation=lambda row, classifier: heard.append((row["round"], classifier)))
    assert [number for number, _ in heard] == [0, 2, 4] == result.metrics["round"].to_list()
    with np.load(tmp_path / "classifier.npz") as saved:
        assert np.array_equal(result.classifier.weight.numpy(), saved["W"])
        assert np.array_equal(result.classifier.bias.numpy(), saved["bias"])
    final = heard[-1][1]
    assert torch.equal(final.weight, result.classifier.weight) and torch.equal(final.bias, result.classifier.bias)
    assert not torch.equal(heard[0][1].weight, final.weight)  # the round-0 head, kept as it was then
    assert final.weight.shape == (8, 20)
    assert len(result.rounds) == 4 and all(len(np.unique(clients)) == 10 for clients in result.rounds)


def test_results_compare_as_values_wherever_they_were_written(ray_session, tmp_path):
    first = fedray.run(method="fedncm", dataset=SPEC, out=tmp_path / "first", rounds=4, eval_every=2, **SMALL_RUN)
    second = fedray.run(method="fedncm", dataset=SPEC, out=tmp_path / "second", rounds=4, eval_every=2, **SMALL_RUN)
    other = fedray.run(method="fedncm", dataset=SPEC, out=tmp_path / "other", rounds=4, eval_every=2, seed=1,
                       **SMALL_RUN)
    assert first == second and first.rounds == second.rounds   # the same configuration: equal results
    assert first != other and first.rounds != other.rounds      # another seed draws other rounds


class Spread(fedray.Callback):
    """A researcher's column: the largest entry of each row's classifier, and how many rows this copy heard."""

    def __init__(self):
        self.rows = 0

    def on_evaluation(self, row, classifier):
        self.rows += 1
        return {"largest_weight": float(classifier.weight.max()), "rows_heard": self.rows}


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_sweep_from_python_returns_its_results_table_with_its_callbacks_columns(ray_session, tmp_path):
    table = fedray.sweep({"name": "seeds", "base": {"dataset": SPEC, "method": "fedncm", "eval_every": 100},
                          "grid": {"seed": [0, 1]}, "cpus_per_shard": 0.5, "driver_cpus": 0.5},
                         out=tmp_path, quiet=True, callbacks=[Spread()])
    assert table.equals(pl.read_parquet(tmp_path / "seeds" / "results.parquet"))
    assert sorted(table["seed"].to_list()) == [0, 1] and table["trial_id"].n_unique() == 2
    # one row a trial, after every client was seen: FedNCM's classifier of all 186 clients, whatever the seed
    assert np.abs(table["largest_weight"].to_numpy() - class_means(np.arange(186)).max()).max() <= 1e-12
    assert table["rows_heard"].to_list() == [1.0, 1.0]  # each trial ran its own copy of the callback
    # what made each trial, as its run.json says it, in columns env_NAME
    environment = [f"env_{name}" for name in FIELDS]
    assert [name for name in table.columns if name.startswith("env_")] == environment
    recorded = [json.loads(path.read_text()) for path in sorted((tmp_path / "seeds").glob("*/run.json"))]
    assert sorted(table.select(environment).rows()) == sorted(tuple(made.values()) for made in recorded)
    assert table["env_command"].to_list() == ["fedray.sweep"] * 2
    assert table["env_torch"].to_list() == [torch.__version__] * 2
    assert table["env_shards"].to_list() == table["num_shards"].to_list()


def test_a_sweep_from_python_is_checked_like_a_sweep_file(tmp_path):
    with pytest.raises(fedray.FedrayError, match=r"^sweep: grid.lamda is not a run option; did you mean lam\?$"):
        fedray.sweep({"name": "x", "grid": {"lamda": [0.1]}}, out=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_spherefed_reports_its_fixed_classifier_then_the_calibrated_one(ray_session, tmp_path):
    heard = []
    result = fedray.run(method="fedavg", head="sphere", sphere_dim=6, dataset=SPEC, out=tmp_path, rounds=2, eval_every=1,
                        client_lr=0.05, **SMALL_RUN, on_evaluation=lambda row, classifier: heard.append((row, classifier)))
    assert [(row["round"], row["stage"]) for row, _ in heard] == [(0, "train"), (1, "train"), (2, "train"), (3, "calibrated")]
    with np.load(tmp_path / "classifier.npz") as saved:
        assert sorted(saved.files) == ["W", "fixed_classifier", "proj_bias", "proj_weight"]
        assert np.array_equal(heard[0][1].weight.numpy(), saved["fixed_classifier"].T)  # training moves the projection
        assert sorted(result.arrays) == ["fixed_classifier", "proj_bias", "proj_weight"]
    assert torch.equal(heard[-1][1].weight, result.classifier.weight) and result.classifier.weight.shape == (6, 20)
    # two training rounds of 10 clients, then the calibration's one round of every client
    assert [len(clients) for clients in result.rounds] == [10, 10, 186]
    assert np.array_equal(result.rounds[-1], np.arange(186))


def test_a_diverged_runs_rounds_end_at_the_round_it_stopped(ray_session, tmp_path):
    result = fedray.run(method="fedavg", dataset=SPEC, out=tmp_path, rounds=20, eval_every=5, client_lr=1e30, **SMALL_RUN)
    assert result.metrics.select("round", "diverged").rows() == [(0, False), (1, True)]
    assert len(result.rounds) == 1 and len(np.unique(result.rounds[0])) == 10


class Doubling(fedray.Postprocessor):
    """Doubles the server's sum: Fed3R's ZᵀZ and ZᵀY twice over are Fed3R at half the λ."""

    def aggregate(self, total, context):
        return {name: 2 * tensor for name, tensor in total.items()}


def test_a_postprocessor_is_given_as_a_class_or_a_list_of_classes(ray_session, tmp_path):
    plain = fedray.run(method="fed3r", dataset=SPEC, out=tmp_path / "plain", lam=0.01, **SMALL_RUN)
    once = fedray.run(method="fed3r", dataset=SPEC, out=tmp_path / "once", postprocessor=Doubling, lam=0.02, **SMALL_RUN)
    twice = fedray.run(method="fed3r", dataset=SPEC, out=tmp_path / "twice", postprocessor=[Doubling, Doubling],
                       lam=0.04, **SMALL_RUN)
    for result in (once, twice):
        torch.testing.assert_close(result.classifier.weight, plain.classifier.weight, rtol=1e-10, atol=1e-12)
    assert once.metrics["postprocessor"][0] == "tests.app.test_api:Doubling"
    assert twice.metrics["postprocessor"][0] == "tests.app.test_api:Doubling,tests.app.test_api:Doubling"


def test_a_postprocessor_that_is_not_a_class_is_one_line(tmp_path):
    with pytest.raises(fedray.FedrayError, match=r"^fedray.run: postprocessor must be a name, 'module:Class', 'file.py:Class', "
                                                 r"a class, or a list of them, got \[<class 'tests.app.test_api.Doubling'>, 3\]$"):
        fedray.run(method="fed3r", dataset=SPEC, out=tmp_path, postprocessor=[Doubling, 3])
