"""Data from Python: ``fedray.run(dataset=Federation.from_arrays(...))`` and a dataset function
(``--dataset file.py:function?key=value``) run as the same rows written to Parquet do, bit for bit."""

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import fedray
from fedray.app.cli import main
from fedray.core.errors import FedrayError

REPO = Path(__file__).resolve().parents[2]
SMALL = {"num_shards": 2, "cpus_per_shard": 0.5, "quiet": True, "clients_per_round": 5, "eval_every": 2}
RUNS = {
    "fed3r": {},
    "fedavg": {"rounds": 4, "local_epochs": 1, "batch_size": 8, "client_lr": 0.05},
}
DATASET_FUNCTION = '''
import numpy as np
import fedray


def toy_rows(clients: int, seed: int):
    """About 10 train rows for each of ``clients`` clients (ids 1000 - 3k, ints) and 80 test rows, d = 8, C = 6."""
    rng = np.random.default_rng(seed)
    n_train = 10 * clients
    n = n_train + 80
    labels = rng.integers(6, size=n)
    means = rng.standard_normal((6, 8)) * 2
    features = (means[labels] + rng.standard_normal((n, 8))).astype(np.float32)
    owners = 1000 - 3 * rng.integers(clients, size=n)
    split = np.array(["train"] * n_train + ["test"] * 80)[rng.permutation(n)]
    return features, labels, owners, split


def toy(clients: int = 30, seed: int = 0):
    return fedray.Federation.from_arrays(*toy_rows(clients, seed), name="toy")
'''


@pytest.fixture(scope="module")
def toy_module(tmp_path_factory):
    """The dataset function's file, and its namespace (the test builds the same rows from it)."""
    path = tmp_path_factory.mktemp("toy") / "toy_data.py"
    path.write_text(DATASET_FUNCTION)
    namespace: dict = {}
    exec(DATASET_FUNCTION, namespace)
    return path, namespace


@pytest.fixture(scope="module")
def toy_parquet(toy_module, tmp_path_factory):
    """The toy rows in the Parquet schema (test rows' clients null)."""
    features, labels, owners, split = toy_module[1]["toy_rows"](30, 0)
    path = tmp_path_factory.mktemp("parquet") / "toy.parquet"
    pq.write_table(pa.table({
        "client_id": pa.array([int(o) if s == "train" else None for o, s in zip(owners, split)], pa.int64()),
        "split": split.tolist(),
        "label": labels,
        "features": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), 8),
    }), path)
    return path


@pytest.fixture(scope="module")
def parquet_runs(ray_session, toy_parquet, tmp_path_factory):
    outs = {}
    for method, options in RUNS.items():
        outs[method] = tmp_path_factory.mktemp(f"parquet-{method}")
        fedray.run(method=method, dataset=f"parquet:{toy_parquet}", out=outs[method], **SMALL, **options)
    return outs


def metrics_rows(out: Path) -> list[dict]:
    return pq.read_table(out / "metrics.parquet").to_pylist()


def assert_same_run(out: Path, reference: Path) -> None:
    """Every metrics column but the dataset's name and the wall-clock times, and every classifier array, bitwise."""
    def comparable(rows):
        return [{k: (repr(v) if isinstance(v, float) else v) for k, v in row.items() if k not in ("dataset", "wall_s")}
                for row in rows]
    assert comparable(metrics_rows(out)) == comparable(metrics_rows(reference))
    with np.load(out / "classifier.npz") as mine, np.load(reference / "classifier.npz") as theirs:
        assert sorted(mine) == sorted(theirs)
        for key in mine:
            assert mine[key].dtype == theirs[key].dtype and mine[key].tobytes() == theirs[key].tobytes(), key


@pytest.mark.parametrize("method", RUNS)
def test_a_federation_from_arrays_runs_as_its_parquet_file(parquet_runs, toy_module, tmp_path, method):
    federation = fedray.Federation.from_arrays(*toy_module[1]["toy_rows"](30, 0), name="toy")
    assert federation.num_clients > 25
    metrics = fedray.run(method=method, dataset=federation, out=tmp_path, **SMALL, **RUNS[method]).metrics
    assert_same_run(tmp_path, parquet_runs[method])
    assert len(metrics) >= 2 and metrics["accuracy"][-1] > 0.3  # chance is 1/6
    label = metrics["dataset"][0]
    assert re.fullmatch(r"memory:toy@[0-9a-f]{12}", label), label
    assert set(metrics["dataset"]) == {label}
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["dataset"] == label


def test_the_label_follows_the_content(toy_module):
    rows = toy_module[1]["toy_rows"](30, 0)
    from fedray.data.memory import memory_label

    same = memory_label(fedray.Federation.from_arrays(*rows, name="toy"))
    assert memory_label(fedray.Federation.from_arrays(*[np.copy(column) for column in rows], name="toy")) == same
    features = rows[0].copy()
    features[7, 3] = np.nextafter(features[7, 3], np.float32(np.inf))  # one feature, one ulp
    assert memory_label(fedray.Federation.from_arrays(features, *rows[1:], name="toy")) != same
    assert memory_label(fedray.Federation.from_arrays(*rows, name="other")).startswith("memory:other@")


def test_its_config_cannot_be_rerun_from_the_command_line(parquet_runs, toy_module, tmp_path, capsys):
    federation = fedray.Federation.from_arrays(*toy_module[1]["toy_rows"](30, 0), name="toy")
    fedray.run(method="fed3r", dataset=federation, out=tmp_path / "first", **SMALL)
    capsys.readouterr()
    assert main(["run", "--config", str(tmp_path / "first" / "config.yaml"), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedray: error: dataset 'memory:toy@") and err.count("\n") == 1, err
    assert "is a federation built in Python" in err and "fedray.run(dataset=federation)" in err
    assert not (tmp_path / "again").exists()


def test_a_dataset_function_runs_from_the_command_line(parquet_runs, toy_module, tmp_path, capsys):
    path, _ = toy_module
    capsys.readouterr()
    rc = main(["run", "--method", "fed3r", "--dataset", f"{path}:toy?clients=30&seed=0", "--out", str(tmp_path),
               *[f"--{key.replace('_', '-')}" if value is True else f"--{key.replace('_', '-')}={value}"
                 for key, value in SMALL.items()]])
    assert rc == 0, capsys.readouterr().err
    assert_same_run(tmp_path, parquet_runs["fed3r"])
    assert {row["dataset"] for row in metrics_rows(tmp_path)} == {f"{path}:toy?clients=30&seed=0"}


def test_bad_data_from_python_is_one_line_before_any_work(ray_session, toy_module, tmp_path):
    features, labels, owners, split = toy_module[1]["toy_rows"](30, 0)
    train_only = fedray.Federation.from_arrays(features, labels, owners, np.full(len(split), "train"), name="toy")
    with pytest.raises(FedrayError, match=r"^toy: no test rows \(split 'test'\)"):
        fedray.run(method="fed3r", dataset=train_only, out=tmp_path / "out", **SMALL)
    with pytest.raises(FedrayError, match=r"^fedray.run: dataset must be a spec .* or a fedray.Federation, got ndarray$"):
        fedray.run(method="fed3r", dataset=features, out=tmp_path / "out", **SMALL)
    assert not (tmp_path / "out").exists()


def test_the_readme_examples_run_as_written(ray_session, tmp_path, monkeypatch, capsys):
    section = (REPO / "docs" / "data.md").read_text().split("## Your own data from Python", 1)[1].split("\n## ", 1)[0]
    notebook, dataset_file = (block.split("```", 1)[0] for block in section.split("```python\n")[1:3])
    bash = section.split("```bash\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(notebook, namespace)
    assert re.fullmatch(r"memory:mine@[0-9a-f]{12}\n", capsys.readouterr().out)
    assert namespace["same"].table.equals(namespace["federation"].table)
    dirichlet = pq.read_table(tmp_path / "results" / "mine-dirichlet" / "metrics.parquet").column("dataset").to_pylist()
    assert dirichlet[0].startswith("memory:mine?alpha=0.1&clients=20&split=dirichlet@")

    assert dataset_file.startswith("# my_data.py\n")
    (tmp_path / "my_data.py").write_text(dataset_file)
    run, info = (shlex.split(line.split("  #")[0]) for line in bash.strip().splitlines())
    assert run[0] == info[0] == ".venv/bin/fedray"
    capsys.readouterr()
    assert main(run[1:]) == 0, capsys.readouterr().err
    assert {row["dataset"] for row in metrics_rows(tmp_path / "results" / "blobs")} == {"my_data.py:blobs?users=100&seed=1"}
    capsys.readouterr()
    assert main(info[1:]) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert (summary["clients_K"], summary["classes_C"], summary["dim_d"]) == (20, 10, 16)
    assert summary["dataset"] == "my_data.py:blobs?split=dirichlet&alpha=0.1&clients=20"
