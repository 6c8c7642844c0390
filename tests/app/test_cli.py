"""The ``fedray`` command line, called in-process: help, data info/export, runs, config files, bad input."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from fedray.app.cli import main
from fedray.engine.config import resolve
from fedray.engine.config_files import load_config_file
from fedray.data.registry import load_federation
from tests.local_cluster import free_port

REPO = Path(__file__).resolve().parents[2]
SPEC = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"
SMALL_RUN = ["--num-shards", "2", "--cpus-per-shard", "0.5", "--quiet"]
METRIC_COLUMNS = {"method", "dataset", "seed", "round", "clients_seen", "samples_seen", "accuracy", "bytes_up",
                  "bytes_down", "wall_s"}
EVALUATION_COLUMNS = ["round", "clients_seen", "samples_seen", "accuracy", "bytes_up", "bytes_down", "flops_client_avg",
                      "wall_s", "stage", "train_loss", "diverged", "comm_floats_fedcof", "comm_floats_fed3r",
                      "macs_client_avg_fed3r", "forward_passes"]
FED3R_COLUMNS = ["method", "dataset", "clients_per_round", "participation", "sampling", "rounds", "eval_every", "seed",
                 "lam", "bias", "backbone_macs", "num_trainers", "cpus_per_trainer", "num_shards", "cpus_per_shard",
                 *EVALUATION_COLUMNS]
"""A fed3r run's columns: its options (every run's, sampling, resources, and fed3r's own λ and bias: not the other
methods', training's, SphereFed's, fine-tuning's or TCT's), then the evaluation point's."""


def cli(capsys, *args):
    """``fedray ARGS`` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def run_cli(capsys, dataset, out, *extra, method="fed3r"):
    return cli(capsys, "run", "--method", method, "--dataset", dataset, "--out", out, *SMALL_RUN, *extra)


def weight(out):
    with np.load(Path(out) / "classifier.npz") as arrays:
        return arrays["W"]


def metrics(out):
    return pq.read_table(Path(out) / "metrics.parquet").to_pylist()


def without_wall(rows):
    return [{k: v for k, v in row.items() if k not in ("wall_s", "dataset")} for row in rows]


def nothing_written(out):
    out = Path(out)
    return not out.exists() or not any(out.iterdir())


# --- help --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv", [[], ["run"], ["extract"], ["sweep"], ["data"], ["data", "info"], ["data", "export"], ["sampling"], ["sampling", "coverage"]]
)
def test_help(capsys, argv):
    with pytest.raises(SystemExit) as exit:
        main([*argv, "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fedray" + "".join(" " + a for a in argv))


def test_python_m_fedray_help():
    result = subprocess.run([sys.executable, "-m", "fedray", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: fedray")
    for command in ("run", "data", "sampling"):
        assert command in result.stdout


HEAVY_MODULES = ("torch", "ray", "polars", "pyarrow")
"""What the answers that need no data must not import (seconds between them, torch 3 of those)."""


def test_help_methods_and_refusals_import_no_heavy_module():
    """The parser, ``--help``, ``fedray methods`` and a refusal before any data import none of torch, Ray, polars or
    pyarrow: checked in one fresh process, whose modules are the command line's alone."""
    script = (
        "import contextlib, io, sys\n"
        "from fedray.app.cli import main\n"
        "for argv in (['--help'], ['run', '--help'], ['methods'], ['run', '--lamda', '1'], ['run', '--option', 'x=1'],"
        " ['run', '--participation', '2'], ['compare', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        f"print(','.join(name for name in {HEAVY_MODULES!r} if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "\n"


SPEC_REFUSAL_MODULES = ("torch", "ray", "polars", "pandas", "scipy")
"""What a refusal of the dataset spec must not import: it reads no data."""


def test_refusals_of_the_dataset_spec_import_no_torch_nor_ray():
    """An unknown synthetic split, a dataset option of the wrong type and a population of no clients are refused before
    torch is imported (seconds) and before Ray starts: checked in one fresh process."""
    script = (
        "import contextlib, io, sys\n"
        "from fedray.app.cli import main\n"
        "codes, errors = [], io.StringIO()\n"
        "for dataset in ('synthetic:nosuch', 'synthetic:cifar100?dim=abc', 'synthetic:inat-user-120k?clients=0'):\n"
        "    with contextlib.redirect_stderr(errors):\n"
        "        codes.append(main(['run', '--method', 'fed3r', '--dataset', dataset, '--out', '/nonexistent/out']))\n"
        "print(codes, len(errors.getvalue().splitlines()))\n"
        f"print(','.join(name for name in {SPEC_REFUSAL_MODULES!r} if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[2, 2, 2] 3\n\n"


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: command; see fedray --help"),
    (["run", "--lamda", "0.1"], "unrecognized arguments: --lamda 0.1; see fedray run --help"),
    (["run", "--sampling", "sometimes"], "argument --sampling: invalid choice: 'sometimes' (choose from 'without', "
                                         "'with', 'poisson'); see fedray run --help"),
    (["data", "info", "x", "--dim", "3"], "unrecognized arguments: --dim 3; see fedray data info --help"),
    (["sampling", "coverage", "--clients", "ten"], "argument --clients: invalid int value: 'ten'; "
                                                   "see fedray sampling coverage --help"),
])
def test_a_usage_error_is_one_line_saying_where_to_look(capsys, argv, message):
    assert cli(capsys, *argv) == (2, "", f"fedray: error: {message}\n")


def test_the_summary_line_says_the_accuracy_is_the_tests_and_of_which_stage():
    from fedray.app.cli import summary_line
    from fedray.engine.config import resolve

    config = resolve({}, {"method": "fedavg", "init": "fed3r", "dataset": SPEC, "out": "results/x"})
    last = {"accuracy": 0.02461, "stage": "train", "round": 12, "clients_seen": 40, "bytes_up": 2.5e6}
    assert summary_line(config, last) == (f"fedavg on {SPEC}: test accuracy 0.0246 (stage train) after 12 rounds, "
                                          f"40 clients seen, 2.5 MB up → results/x")


def test_the_summary_line_of_a_job_names_the_folder_in_rays_copy_of_its_working_dir(tmp_path, monkeypatch):
    """``ray job submit --working-dir .`` runs ``fedray run --out results/x`` in Ray's unpacked copy on the head."""
    from fedray.app.cli import summary_line
    from fedray.engine.config import resolve

    copy = tmp_path / "session_latest" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    config = resolve({}, {"method": "fed3r", "dataset": SPEC, "out": "results/x"})
    last = {"accuracy": 0.5, "stage": "closed_form", "round": 3, "clients_seen": 30, "bytes_up": 1e6}
    assert summary_line(config, last) == (
        f"fed3r on {SPEC}: test accuracy 0.5000 (stage closed_form) after 3 rounds, 30 clients seen, 1.0 MB up → "
        f"{copy}/results/x\nnote: {copy}/results/x is inside Ray's copy of the job's --working-dir on the node that ran "
        "it (not where the job was sent from), removed with Ray's session files: give an absolute --out on storage you "
        "can read to keep the results")


# --- data info / export ------------------------------------------------------------------------------------


def test_data_info_matches_the_federation_summary(capsys):
    rc, out, err = cli(capsys, "data", "info", SPEC)
    assert rc == 0 and err == ""
    printed = json.loads(out)
    summary = load_federation(SPEC).summary()
    assert printed == summary
    for key in ("clients_K", "classes_C", "train_N", "test_N", "client_class_pairs_M"):
        assert printed[key] == summary[key]
    assert printed["classes_C"] == 20 and printed["dim_d"] == 8


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "sub" / "federation.parquet"
    assert main(["data", "export", SPEC, "--out", str(path)]) == 0
    return path


def test_export_writes_the_byo_schema(exported):
    assert [p.name for p in exported.parent.iterdir()] == ["federation.parquet"]  # no *.tmp left
    table = pq.read_table(exported)
    federation = load_federation(SPEC)
    assert table.column_names == ["client_id", "split", "label", "features"]
    assert table.schema.field("features").type == pa.list_(pa.float32(), 8)
    assert table.schema.metadata[b"fedray.num_classes"] == b"20"
    assert table.num_rows == federation.table.num_rows
    assert pq.read_table(exported, filters=[("split", "=", "test")]).column("client_id").null_count == \
        federation.test.num_rows
    assert load_federation(f"parquet:{exported}").summary() | {"dataset": None} == federation.summary() | {"dataset": None}


# --- runs: synthetic vs exported Parquet, config.yaml round trips -----------------------------------------


@pytest.fixture(scope="module")
def synthetic_run(ray_session, tmp_path_factory):
    """fed3r on SPEC with κ from --participation 0.27: ⌈0.27 · 186⌉ = 51 clients a round, 4 rounds."""
    out = tmp_path_factory.mktemp("runs") / "synthetic"
    assert main(["run", "--method", "fed3r", "--dataset", SPEC, "--out", str(out), *SMALL_RUN,
                 "--participation", "0.27", "--eval-every", "2"]) == 0
    return out


def test_run_outputs(synthetic_run):
    assert sorted(p.name for p in synthetic_run.iterdir()) == ["classifier.npz", "config.yaml", "metrics.parquet",
                                                               "run.json"]
    made = json.loads((synthetic_run / "run.json").read_text())
    assert made["command"] == shlex.join(["fedray", "run", "--method", "fed3r", "--dataset", SPEC, "--out",
                                          str(synthetic_run), *SMALL_RUN, "--participation", "0.27",
                                          "--eval-every", "2"])
    assert (made["shards"], made["cpus_per_shard"], made["threads"]) == (2, 0.5, 1)
    table = pq.read_table(synthetic_run / "metrics.parquet")
    assert METRIC_COLUMNS <= set(table.column_names)
    assert table.column_names == FED3R_COLUMNS
    config = yaml.safe_load((synthetic_run / "config.yaml").read_text())  # every option, to run it again
    assert (config["gamma"], config["client_lr"], config["entk_dim"], config["out"]) == (0.1, 0.1, 100_000, str(synthetic_run))
    rows = table.to_pylist()
    federation = load_federation(SPEC)
    assert federation.num_clients == 186
    # 4 rounds evaluated every 2 → one row at round 2, one at round 4.
    assert [r["round"] for r in rows] == [2, 4]
    assert [r["clients_seen"] for r in rows] == [102, 186]
    assert rows[-1]["samples_seen"] == federation.train.num_rows
    assert rows[0]["samples_seen"] < rows[1]["samples_seen"]
    assert 0 < rows[0]["bytes_up"] < rows[1]["bytes_up"]
    assert all(r["bytes_down"] == 0 for r in rows)
    assert all(0 <= r["accuracy"] <= 1 for r in rows)
    assert rows[0]["wall_s"] <= rows[1]["wall_s"]
    for row in rows:
        assert (row["method"], row["dataset"], row["seed"], row["clients_per_round"], row["participation"],
                row["sampling"], row["lam"], row["num_shards"], row["cpus_per_shard"]) == \
            ("fed3r", SPEC, 0, 51, 0.27, "without", 0.01, 2, 0.5)
    config = yaml.safe_load((synthetic_run / "config.yaml").read_text())
    assert config["out"] == str(synthetic_run) and config["participation"] == 0.27
    assert weight(synthetic_run).shape == (8, 20)


def test_exported_parquet_gives_the_same_run(synthetic_run, exported, tmp_path, capsys):
    rc, out, err = run_cli(capsys, f"parquet:{exported}", tmp_path / "parquet", "--participation", "0.27",
                           "--eval-every", "2")
    assert rc == 0, err
    assert "fed3r on parquet:" in out
    assert np.allclose(weight(tmp_path / "parquet"), weight(synthetic_run), rtol=1e-10, atol=0)
    rows = metrics(tmp_path / "parquet")
    assert without_wall(rows) == without_wall(metrics(synthetic_run))
    assert {r["dataset"] for r in rows} == {f"parquet:{exported}"}


def test_config_yaml_round_trips(synthetic_run, tmp_path, capsys):
    rc, _, err = cli(capsys, "run", "--config", synthetic_run / "config.yaml", "--out", tmp_path / "again")
    assert rc == 0, err
    assert np.allclose(weight(tmp_path / "again"), weight(synthetic_run), rtol=1e-10, atol=0)
    assert without_wall(metrics(tmp_path / "again")) == without_wall(metrics(synthetic_run))
    first = yaml.safe_load((synthetic_run / "config.yaml").read_text())
    again = yaml.safe_load((tmp_path / "again" / "config.yaml").read_text())
    assert again == {**first, "out": str(tmp_path / "again")}


def test_config_file_with_dashes_and_underscores_and_command_line_override(synthetic_run, tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text(
        f"method: fed3r\n"
        f"dataset: '{SPEC}'\n"
        f"participation: 0.9\n"  # overridden on the command line
        f"eval-every: 2\n"
        f"num-shards: 2\n"
        f"cpus_per_shard: 0.5\n"
        f"lam: 1e-2\n"  # YAML reads this as the string '1e-2'
        f"quiet: true\n"
        f"out: {tmp_path / 'not-here'}\n"
    )
    rc, _, err = cli(capsys, "run", "--config", config, "--participation", "0.27", "--out", tmp_path / "mine")
    assert rc == 0, err
    assert not (tmp_path / "not-here").exists()
    written = yaml.safe_load((tmp_path / "mine" / "config.yaml").read_text())
    assert (written["lam"], written["participation"], written["eval_every"], written["out"]) == \
        (0.01, 0.27, 2, str(tmp_path / "mine"))
    assert np.allclose(weight(tmp_path / "mine"), weight(synthetic_run), rtol=1e-10, atol=0)
    assert without_wall(metrics(tmp_path / "mine")) == without_wall(metrics(synthetic_run))


def test_command_line_per_round_choice_replaces_the_files(synthetic_run):
    file_values = load_config_file(synthetic_run / "config.yaml")
    assert file_values["participation"] == 0.27 and file_values["clients_per_round"] is None
    config = resolve(file_values, {"clients_per_round": 93, "participation": None})
    assert (config.clients_per_round, config.participation) == (93, None)
    config = resolve({**file_values, "participation": None, "clients_per_round": 5}, {"participation": 0.5})
    assert (config.clients_per_round, config.participation) == (None, 0.5)
    assert resolve(file_values, {"lam": 2.0}).participation == 0.27


@pytest.mark.parametrize(
    "text, needles",
    [
        ("clients_per_round: fifty\n", ["option clients_per_round must be an integer", "'fifty'"]),
        ("clients_per_round: 2.5\n", ["option clients_per_round must be an integer", "2.5"]),
        ("lam: small\n", ["option lam must be a number", "'small'"]),
        ("lam: null\n", ["option lam must be a number", "None"]),
        ("bias: 1\n", ["option bias must be true or false"]),
        ("dataset: [1, 2]\n", ["option dataset must be a string"]),
        ("lam: .inf\n", ["option lam must be a finite number", "inf"]),
        ("gamma: .nan\n", ["option gamma must be a finite number", "nan"]),
        ("seed: -1\n", ["option seed must be an integer from 0", "-1"]),
    ],
    ids=["int-word", "int-float", "float-word", "float-null", "bool", "str", "float-inf", "float-nan", "seed-negative"],
)
def test_config_file_values_are_typed(ray_session, tmp_path, capsys, text, needles):
    config = tmp_path / "typed.yaml"
    config.write_text(text)
    out = tmp_path / "out"
    expect_error(capsys, ["run", "--config", config, "--out", out], config, *needles, out=out)


# --- bring-your-own Parquet --------------------------------------------------------------------------------

DIM, CLASSES, LAM = 5, 4, 0.01


def byo_table(client_ids="int", features="list", num_train=60, num_test=20, seed=0):
    """A small federation in the bring-your-own schema: 6 clients, interleaved rows, test rows last-ish."""
    rng = np.random.default_rng(seed)
    n = num_train + num_test
    split = np.array(["train"] * num_train + ["test"] * num_test)
    order = rng.permutation(n)
    split = split[order]
    labels = rng.integers(CLASSES, size=n)
    labels[np.flatnonzero(split == "train")[:CLASSES]] = np.arange(CLASSES)  # every class has training samples
    client = rng.integers(6, size=n)
    names = [f"user-{c}" for c in "fedcba"]
    client_values = [None if s == "test" else (int(1000 - 7 * c) if client_ids == "int" else names[c])
                     for s, c in zip(split, client)]
    x = (rng.standard_normal((n, DIM)) + labels[:, None] * 0.5).astype(np.float32)
    if features == "list":
        feature_array = pa.array(list(x), pa.list_(pa.float32()))
    else:
        feature_array = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel(), pa.float32()), DIM)
    return pa.table({
        "client_id": pa.array(client_values, pa.int64() if client_ids == "int" else pa.string()),
        "split": pa.array(split, pa.string()),
        "label": pa.array(labels, pa.int64()),
        "features": feature_array,
    })


def centralized_ridge(table):
    train = table.filter(pc.equal(table.column("split"), "train"))
    z = torch.from_numpy(np.stack(train.column("features").to_pylist()).astype(np.float32)).to(torch.float64)
    y = torch.nn.functional.one_hot(torch.from_numpy(train.column("label").to_numpy().copy()), CLASSES).to(torch.float64)
    w = torch.linalg.solve(z.T @ z + LAM * torch.eye(DIM, dtype=torch.float64), z.T @ y)
    return (w / w.norm(dim=0)).numpy()


@pytest.mark.parametrize("client_ids, features", [("int", "list"), ("string", "fixed_size_list")])
def test_byo_parquet_gives_the_centralized_ridge(ray_session, tmp_path, capsys, client_ids, features):
    table = byo_table(client_ids, features)
    assert table.column("client_id").null_count == 20
    path = tmp_path / "byo.parquet"
    pq.write_table(table, path)
    rc, _, err = cli(capsys, "run", "--method", "fed3r", "--dataset", f"parquet:{path}", "--out", tmp_path / "out",
                     "--num-shards", "1", "--cpus-per-shard", "0.5", "--quiet", "--clients-per-round", "2",
                     "--lam", LAM)
    assert rc == 0, err
    w = weight(tmp_path / "out")
    reference = centralized_ridge(table)
    assert w.shape == (DIM, CLASSES)
    assert np.abs(w - reference).max() / np.abs(reference).max() <= 1e-8
    rows = metrics(tmp_path / "out")
    assert rows[-1]["round"] == 3 and rows[-1]["clients_seen"] == 6 and rows[-1]["samples_seen"] == 60
    assert 0 <= rows[-1]["accuracy"] <= 1


def test_a_default_per_round_larger_than_the_federation_says_it_was_the_default(ray_session, tmp_path, capsys):
    path = tmp_path / "six-clients.parquet"
    pq.write_table(byo_table(), path)
    out = tmp_path / "out"
    expect_error(capsys, ["run", "--dataset", f"parquet:{path}", "--out", out, *SMALL_RUN],
                 "--clients-per-round must be between 1 and the 6 clients", "its default 10", "--participation", out=out)
    err = expect_error(capsys, ["run", "--dataset", f"parquet:{path}", "--out", out, *SMALL_RUN, "--clients-per-round", "7"],
                       "--clients-per-round", "6 clients", "got 7", out=out)
    assert "default" not in err


# --- bad input: one line on stderr, exit code 2, nothing written -------------------------------------------


def expect_error(capsys, args, *needles, out=None):
    rc, stdout, err = cli(capsys, *args)
    assert rc == 2, (stdout, err)
    assert err.startswith("fedray: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    for needle in needles:
        assert str(needle) in err, (needle, err)
    if out is not None:
        assert nothing_written(out)
    return err


def with_column(table, name, array):
    return table.set_column(table.column_names.index(name), name, array)


def replaced_features(table, row, values, dtype=pa.float32()):
    rows = table.column("features").to_pylist()
    rows[row] = values
    return with_column(table, "features", pa.array(rows, pa.list_(dtype)))


def _missing_column(t):
    return t.drop_columns(["label"]), ["missing column(s) label"]


def _label_float(t):
    return with_column(t, "label", t.column("label").cast(pa.float64())), ["column 'label' must be integers", "double"]


def _features_strings(t):
    strings = pa.array([[str(v) for v in row] for row in t.column("features").to_pylist()], pa.list_(pa.string()))
    return with_column(t, "features", strings), ["column 'features' must hold floats", "string"]


def _features_one_string(t):
    return with_column(t, "features", pa.array(["1,2,3"] * t.num_rows)), ["column 'features' must be a list of floats"]


def _negative_label(t):
    labels = t.column("label").to_numpy().copy()
    labels[7] = -3
    return with_column(t, "label", pa.array(labels)), ["row 7", "negative label -3"]


def _label_out_of_range(t):
    labels = t.column("label").to_numpy().copy()
    labels[11] = CLASSES
    t = with_column(t, "label", pa.array(labels))
    return t.replace_schema_metadata({b"fedray.num_classes": str(CLASSES).encode()}), \
        ["row 11", f"label {CLASSES} out of range for {CLASSES} classes"]


def _bad_num_classes(t):
    return t.replace_schema_metadata({b"fedray.num_classes": b"four"}), ["fedray.num_classes", "four"]


def _nan(t):
    return replaced_features(t, 13, [0.0, float("nan"), 0.0, 0.0, 0.0]), ["NaN or inf", "row 13"]


def _inf(t):
    return replaced_features(t, 17, [0.0, 0.0, float("-inf"), 0.0, 0.0]), ["NaN or inf", "row 17"]


def _mixed_lengths(t):
    return replaced_features(t, 5, [1.0] * (DIM + 1)), ["mixed feature lengths", "row 5", str(DIM + 1)]


def _no_train_rows(t):
    t = t.filter(pc.equal(t.column("split"), "test"))
    return t, ["no training samples"]


def _train_row_without_client(t):
    clients = t.column("client_id").to_pylist()
    row = next(i for i, s in enumerate(t.column("split").to_pylist()) if s == "train" and i > 0)
    clients[row] = None
    return with_column(t, "client_id", pa.array(clients, pa.int64())), [f"row {row}", "train row without client_id"]


def _stray_huge_label(t):
    labels = t.column("label").to_numpy().copy()
    labels[9] = 50_000_000
    return with_column(t, "label", pa.array(labels)), \
        ["row 9", "label 50000000", "C = max label + 1 = 50,000,001 classes", f"only {CLASSES + 1} distinct", "fedray.num_classes"]


def _bad_split(t):
    splits = t.column("split").to_pylist()
    splits[3] = "validation"
    return with_column(t, "split", pa.array(splits)), ["row 3", "'validation'"]


BAD_FILES = {f.__name__[1:]: f for f in (
    _missing_column, _label_float, _features_strings, _features_one_string, _negative_label, _label_out_of_range,
    _bad_num_classes, _nan, _inf, _mixed_lengths, _no_train_rows, _train_row_without_client, _bad_split,
    _stray_huge_label,
)}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_parquet_is_one_line_error(ray_session, tmp_path, capsys, case):
    table, needles = BAD_FILES[case](byo_table())
    path = tmp_path / f"{case}.parquet"
    pq.write_table(table, path)
    out = tmp_path / "out"
    expect_error(capsys, ["run", "--dataset", f"parquet:{path}", "--out", out, *SMALL_RUN, "--clients-per-round", "2"],
                 path, *needles, out=out)
    # data info reports the same error
    expect_error(capsys, ["data", "info", f"parquet:{path}"], path, *needles)


def test_a_large_class_count_is_kept_when_the_metadata_sets_it(tmp_path, capsys):
    table = byo_table()
    labels = table.column("label").to_numpy().copy()
    labels[9] = 200_000
    path = tmp_path / "declared.parquet"
    pq.write_table(with_column(table, "label", pa.array(labels)).replace_schema_metadata({b"fedray.num_classes": b"200001"}), path)
    rc, out, err = cli(capsys, "data", "info", f"parquet:{path}")
    assert rc == 0, err
    assert json.loads(out)["classes_C"] == 200_001


def test_a_federation_without_test_rows_is_refused_before_the_run(ray_session, tmp_path, capsys):
    path = tmp_path / "train-only.parquet"
    pq.write_table(byo_table(num_test=0), path)
    out = tmp_path / "out"
    expect_error(capsys, ["run", "--dataset", f"parquet:{path}", "--out", out, *SMALL_RUN, "--clients-per-round", "2"],
                 path, "no test rows", "nothing to evaluate", out=out)
    rc, info, err = cli(capsys, "data", "info", f"parquet:{path}")  # inspecting it is fine
    assert rc == 0 and json.loads(info)["test_N"] == 0, err


def test_not_a_parquet_file(ray_session, tmp_path, capsys):
    path = tmp_path / "garbage.parquet"
    path.write_bytes(b"PAR1 this is not parquet at all \x00\x01\x02" * 10)
    out = tmp_path / "out"
    expect_error(capsys, ["run", "--dataset", f"parquet:{path}", "--out", out, *SMALL_RUN], path,
                 "not a readable Parquet file", out=out)
    expect_error(capsys, ["run", "--dataset", f"parquet:{tmp_path / 'absent.parquet'}", "--out", out, *SMALL_RUN],
                 "absent.parquet", "no such file", out=out)


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--dataset", "nope:thing"], ["unknown dataset 'nope:thing'"]),
        (["--dataset", "synthetic:no-such-split"], ["unknown synthetic split 'no-such-split'"]),
        (["--dataset", SPEC + "&colour=red"], ["unknown option 'colour'"]),
        (["--lam", "0"], ["--lam must be > 0", "0"]),
        (["--lam", "-1"], ["--lam must be > 0", "-1"]),
        (["--method", "fedcof", "--gamma", "-0.5"], ["--gamma must be ≥ 0", "-0.5"]),
        (["--method", "fedcof-oracle", "--option", "covariance=foo"],
         ["--covariance must be full, diagonal or spherical, got 'foo'"]),
        (["--method", "fedncm", "--distance", "l1"], ["--distance must be cosine or euclidean, got 'l1'"]),
        (["--clients-per-round", "1000"], ["--clients-per-round", "186 clients", "1000"]),
        (["--clients-per-round", "0"], ["--clients-per-round", "got 0"]),
        (["--participation", "1.5"], ["--participation must be in (0, 1]", "1.5"]),
        (["--participation", "0.5", "--clients-per-round", "5"], ["--clients-per-round or --participation"]),
        (["--eval-every", "0"], ["--eval-every"]),
        (["--num-shards", "0"], ["--num-shards"]),
        (["--method", "fedavg", "--prox-mu", "0.1"], ["--prox-mu applies to fedprox (training algorithm), not to this run (--method fedavg)"]),
        (["--method", "fedavg", "--client-lr", "0"], ["--client-lr must be > 0", "0"]),
        (["--method", "scaffold", "--resume"], ["checkpoint.pt", "no checkpoint to resume from"]),
        (["--lam", "inf"], ["--lam must be a finite number", "inf"]),
        (["--method", "fedcof", "--gamma", "nan"], ["--gamma must be a finite number", "nan"]),
        (["--method", "fedavg", "--client-lr", "inf"], ["--client-lr must be a finite number", "inf"]),
        (["--participation", "nan"], ["--participation must be a finite number", "nan"]),
        (["--seed", "-1"], ["--seed must be an integer from 0 to 2^63 - 1", "-1"]),
        (["--seed", str(2**64)], ["--seed must be an integer from 0 to 2^63 - 1", str(2**64)]),
        (["--method", "fed3r-rf", "--rf-sigma", "0"], ["--rf-sigma must be > 0", "0"]),
        (["--dataset", SPEC + "&seed=-1"], ["option seed must be an integer from 0", "-1"]),
        (["--dataset", SPEC + "&scale=nan"], ["option scale must be a finite number", "nan"]),
        (["--method", "ffc", "--lam", "-1"], ["--lam must be ≥ 0 for FFC", "-1"]),
        (["--method", "fedavg", "--client-momentum", "1"], ["--client-momentum must be in [0, 1)", "1.0"]),
        (["--method", "fedavg", "--lr-schedule", "cosine"], ["--lr-schedule cosine", "give --rounds"]),
        (["--method", "fedavg", "--lr-schedule", "step"], ["--lr-schedule step needs --lr-milestones"]),
        (["--method", "fedavg", "--lr-schedule", "step", "--lr-milestones", "5,x"], ["--lr-milestones takes", "5,x"]),
        (["--method", "fedavg", "--lr-gamma", "0"], ["--lr-gamma must be > 0", "0"]),
        (["--method", "fedavg", "--backbone", "nosuchnet"],
         ["--backbone applies to fine-tuning on images (--finetune, or --method tct), not to fedavg on the dataset's features"]),
        (["--backbone", "resnet18"], ["--backbone applies to fine-tuning on images", "not to fed3r"]),
        (["--method", "fedavg", "--weights", "random"], ["--weights applies to fine-tuning on images", "not to fedavg"]),
        (["--image-size", "32"], ["--image-size applies to fine-tuning on images", "not to fed3r"]),
        (["--method", "fedavg", "--finetune", "ft", "--backbone", "nosuchnet"],
         ["unknown backbone 'nosuchnet'; known: mobilenet_v2, "]),
        (["--method", "fedavg", "--rounds", "99999999999999999999"],
         ["--rounds must be at most 2^63 - 1, got 99999999999999999999"]),
    ],
    ids=["kind", "split", "option", "lam0", "lam-1", "gamma", "covariance", "distance", "too-many-clients", "zero-clients", "participation",
         "both", "eval-every", "num-shards", "prox-mu", "client-lr", "resume", "lam-inf", "gamma-nan", "client-lr-inf",
         "participation-nan", "seed-negative", "seed-too-large", "rf-sigma-0", "dataset-seed", "dataset-nan", "ffc-lam",
         "momentum", "cosine-rounds", "step-milestones", "milestones-bad", "lr-gamma", "backbone-on-features",
         "backbone-closed-form", "weights-on-features", "image-size-on-features", "unknown-backbone", "rounds-too-many"],
)
def test_bad_option_is_one_line_error(ray_session, tmp_path, capsys, args, needles):
    out = tmp_path / "out"
    base = ["run", "--dataset", SPEC, "--out", out, "--cpus-per-shard", "0.5", "--quiet"]
    expect_error(capsys, [*base, *args], *needles, out=out)


def test_an_infeasible_dirichlet_split_fails_in_seconds_saying_why(tmp_path, capsys):
    spec = "synthetic:inat-user-120k?dim=8&scale=0.05&classes=20&split=dirichlet_per_class&alpha=0.0001&clients=5000"
    out = tmp_path / "out"
    start = time.monotonic()
    expect_error(capsys, ["run", "--dataset", spec, "--out", out, *SMALL_RUN], "alpha=0.0001", "5000 clients",
                 "a small alpha gives each class to few clients", "raise alpha", "min_client_size=0", out=out)
    assert time.monotonic() - start < 30


def fedray_subprocess(args, env=None, timeout=120):
    """``python -m fedray ARGS`` in a fresh process (no Ray yet): (exit code, stdout, stderr, seconds)."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fedray", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    return done.returncode, done.stdout, done.stderr, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--address", "RAY_ADDRESS"])
def test_an_address_where_nothing_listens_fails_in_one_line(tmp_path, how):
    address = f"127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    args = ["run", "--dataset", SPEC, "--out", out, "--quiet"]
    rc, stdout, err, seconds = fedray_subprocess([*args, "--address", address] if how == "--address" else args,
                                                 env={"RAY_ADDRESS": address} if how == "RAY_ADDRESS" else None)
    assert rc == 2, (stdout, err)
    assert err.startswith(f"fedray: error: {how} {address}: no Ray cluster at {address}") and err.count("\n") == 1, err
    assert seconds < 60, "Ray alone retries such an address forever"
    assert nothing_written(out)


@pytest.mark.parametrize("args, needles", [
    (["--num-shards", "500", "--cpus-per-shard", "1"], ["cannot reserve", "--num-shards 500 cut at equal sample counts over 186 clients",
                                                       "the cluster has 2 CPU", "no autoscaler", "lower --num-shards or --cpus-per-shard"]),
    (["--num-shards", "1", "--cpus-per-shard", "4"], ["cannot reserve 1 shard × 4 CPU", "the cluster has 2 CPU", "no autoscaler"]),
], ids=["num-shards", "cpus-per-shard"])
def test_shards_beyond_a_cluster_without_autoscaler_fail_at_once(ray_session, tmp_path, capsys, args, needles):
    out = tmp_path / "out"
    start = time.monotonic()
    expect_error(capsys, ["run", "--dataset", SPEC, "--out", out, "--quiet", *args], *needles, out=out)
    assert time.monotonic() - start < 30, "not the 60 s wait for nodes that no autoscaler will add"


def test_a_run_that_cannot_fit_the_clusters_memory_is_refused_with_the_estimate(ray_session, tmp_path, capsys):
    table = byo_table()
    labels = table.column("label").to_numpy().copy()
    labels[9] = 2_000_000_000
    path = tmp_path / "two-billion-classes.parquet"
    metadata = {b"fedray.num_classes": b"2000000001"}  # declared on purpose, so only the memory estimate can refuse it
    pq.write_table(with_column(table, "label", pa.array(labels)).replace_schema_metadata(metadata), path)
    out = tmp_path / "out"
    err = expect_error(capsys, ["run", "--dataset", f"parquet:{path}", "--out", out, *SMALL_RUN, "--clients-per-round", "2"],
                       "fed3r needs about", "GB of memory", "2 shards of up to", "on the driver",
                       "the p × C targets (float64, p = 5, C = 2,000,000,001)", "more than the cluster's",
                       "lower the number of classes C", out=out)
    needed = float(re.search(r"needs about ([\d.]+) GB", err)[1])
    assert needed > 3 * 5 * 2e9 * 8 / 1e9, "at least three copies of the targets on each shard"


def test_unknown_method_is_a_one_line_error(capsys, tmp_path):
    """--method also takes plugins (module:Class), so a name is checked with the run, not by argparse's choices."""
    rc, _, err = cli(capsys, "run", "--method", "sgd", "--dataset", SPEC, "--out", tmp_path / "out")
    assert rc == 2 and err.count("\n") == 1
    assert "unknown method 'sgd'" in err and "fed3r" in err and "path/to/file.py:Class" in err
    assert nothing_written(tmp_path / "out")


@pytest.mark.parametrize(
    "text, needles",
    [
        (None, ["no such config file"]),
        ("lam: 0.01\nlearning_rate: 0.1\n", ["unknown option(s) learning_rate"]),
        ("method: sgd\n", ["unknown method 'sgd'"]),  # names the option, not the file
        ("- just\n- a list\n", ["mapping"]),
        ("lam: [0.01\n", ["not valid YAML"]),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", ["not a text file (byte 0x89 at offset 0 is not UTF-8); a config file is YAML"]),
        ("lam: 0.01\n".encode("utf-16"), ["not a text file (byte 0xff at offset 0 is not UTF-8)"]),
        ("options: " + "[" * 5000 + "]" * 5000 + "\n", ["nested too deeply to read (a config file holds options, not "
                                                       "thousands of nested lists or mappings)"]),
    ],
    ids=["missing", "unknown-key", "unknown-method", "not-a-mapping", "bad-yaml", "binary", "utf-16", "deep"],
)
def test_bad_config_file_is_one_line_error(ray_session, tmp_path, capsys, text, needles):
    config = tmp_path / "config.yaml"
    if isinstance(text, bytes):
        config.write_bytes(text)
    elif text is not None:
        config.write_text(text)
    out = tmp_path / "out"
    file_named = [] if text == "method: sgd\n" else [config]
    expect_error(capsys, ["run", "--config", config, "--dataset", SPEC, "--out", out, *SMALL_RUN], *file_named,
                 *needles, out=out)


def test_data_commands_bad_input(capsys, tmp_path):
    expect_error(capsys, ["data", "info", "synthetic:no-such-split"], "unknown synthetic split")
    out = tmp_path / "x.parquet"
    expect_error(capsys, ["data", "export", "nope:thing", "--out", out], "unknown dataset", out=tmp_path / "nowhere")
    assert not out.exists() and list(tmp_path.iterdir()) == []


# --- atomic outputs ----------------------------------------------------------------------------------------


def test_second_run_replaces_the_first_atomically(synthetic_run, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(synthetic_run, out)  # the first run's results (rounds 2 and 4, seed 0)
    first = {name: (out / name).read_bytes() for name in os.listdir(out)}
    rc, _, err = run_cli(capsys, SPEC, out, "--clients-per-round", "93", "--eval-every", "100", "--seed", "5")
    assert rc == 0, err
    rows = metrics(out)
    assert [(r["round"], r["clients_per_round"], r["participation"], r["seed"]) for r in rows] == [(2, 93, None, 5)]
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (config["seed"], config["clients_per_round"], config["participation"]) == (5, 93, None)
    assert sorted(os.listdir(out)) == ["classifier.npz", "config.yaml", "metrics.parquet", "run.json"]
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]
    assert all((out / name).read_bytes() != first[name] for name in first)
    # A failing run leaves the previous results as they were.
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    expect_error(capsys, ["run", "--dataset", SPEC, "--out", out, *SMALL_RUN, "--clients-per-round", "1000"],
                 "--clients-per-round")
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


# --- sampling coverage -------------------------------------------------------------------------------------

COVERAGE_LINE = re.compile(r"^\s*(\d+)% of clients seen:\s+([\d.]+) ± ([\d.]+) rounds$")


def coverage_lines(out):
    found = {int(m[1]): (float(m[2]), float(m[3])) for m in map(COVERAGE_LINE.match, out.splitlines()) if m}
    assert sorted(found) == [25, 50, 75, 100], out
    return found


def test_coverage_without_replacement(capsys):
    rc, out, err = cli(capsys, "sampling", "coverage", "--clients", "100", "--per-round", "10")
    assert rc == 0 and err == ""
    assert "K=100 κ=10 without replacement" in out
    assert coverage_lines(out) == {25: (3, 0), 50: (5, 0), 75: (8, 0), 100: (10, 0)}


def test_coverage_with_replacement(capsys):
    rc, out, err = cli(capsys, "sampling", "coverage", "--clients", "100", "--per-round", "10", "--replacement",
                       "--trials", "20")
    assert rc == 0 and err == ""
    assert "with replacement, 20 trials" in out
    means = {f: mean for f, (mean, _) in coverage_lines(out).items()}
    assert means[100] > 10
    assert means[25] <= means[50] <= means[75] <= means[100]
    # coupon collector: K·H_K/κ ≈ 52 rounds for K = 100, κ = 10
    assert 30 < means[100] < 90


def test_coverage_bad_input(capsys):
    err = expect_error(capsys, ["sampling", "coverage", "--clients", "10", "--per-round", "11"], "--per-round", "10 clients", "11")
    assert "--clients-per-round" not in err, "the option as typed for this command"
    expect_error(capsys, ["sampling", "coverage", "--clients", "10", "--per-round", "2", "--trials", "0"], "--trials")
    expect_error(capsys, ["sampling", "coverage", "--clients", "0", "--per-round", "1"], "--clients must be ≥ 1")
    expect_error(capsys, ["sampling", "coverage", "--clients", "10", "--per-round", "2", "--seed", "-1"],
                 "--seed must be an integer from 0", "-1")


TALKING_POSTPROCESSOR = '''
import fedray


class Talk(fedray.Postprocessor):
    @property
    def per_client(self):
        return True

    def client(self, upload, context):
        print("hello from a client hook", flush=True)
        return upload
'''


def talking_run(tmp_path: Path) -> list:
    """``fedray run`` of fed3r with a postprocessor whose client hook prints (in the shards), less its ``--out``."""
    (tmp_path / "talk.py").write_text(TALKING_POSTPROCESSOR)
    return ["run", "--method", "fed3r", "--dataset", SPEC, "--postprocessor", f"{tmp_path / 'talk.py'}:Talk",
            *SMALL_RUN]


@pytest.fixture(scope="module")
def plain_process_run(tmp_path_factory):
    """One ``fedray run`` in a fresh process, without ``--verbose``: (exit code, stdout, stderr)."""
    folder = tmp_path_factory.mktemp("process")
    rc, out, err, _ = fedray_subprocess([*talking_run(folder), "--out", folder / "silent"])
    return rc, out, err


@pytest.mark.slow
def test_a_run_does_not_announce_token_authentication(plain_process_run):
    """Ray's token authentication stays on for the embedded cluster; its notice no longer greets every run."""
    rc, out, err = plain_process_run
    assert rc == 0, err
    assert "Token authentication" not in err and "fed3r on" in out
    assert (Path.home() / ".ray" / "auth_token").is_file()  # the token Ray created or reused: authentication is on


@pytest.mark.slow
def test_verbose_shows_what_a_plugins_client_code_prints_in_the_shards(plain_process_run, tmp_path):
    rc, out, err = plain_process_run
    assert rc == 0, err
    assert "hello from a client hook" not in out + err
    rc, out, err, _ = fedray_subprocess([*talking_run(tmp_path), "--out", tmp_path / "verbose", "--verbose"])
    assert rc == 0, err
    assert "(ShardActor pid=" in out + err and "hello from a client hook" in out + err
