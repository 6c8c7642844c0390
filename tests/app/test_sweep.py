"""Sweeps: the sweep file, Tune trials with their shards in the trial's placement group, results.parquet, resume."""

import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
from ray._private.state import actors

from fedray.app.cli import main
from fedray.data.export import export_parquet
from fedray.data.registry import load_federation
from fedray.core.errors import FedrayError
from fedray.app.sweeps.spec import SweepSpec, load_sweep, with_dataset_options
from fedray.app.sweeps.trials import check_trials, trial_config
from fedray.app.sweeps.tuning import RESULTS, _environment_columns, combine, failure_line, sweep
from fedray.runtime.provenance import FIELDS

SWEEPS = Path(__file__).resolve().parents[2] / "jobs" / "sweeps"
SMALL = {"dim": 16, "scale": 0.04, "classes": 40}


def small(spec, **resources):
    """A shipped sweep at reduced size: every dataset shrunk, two trials at a time on 2 CPUs."""
    base = dict(spec.base)
    grid = dict(spec.grid)
    if "dataset" in base:
        base["dataset"] = with_dataset_options(base["dataset"], {f"dataset.{k}": v for k, v in SMALL.items()})
    if "dataset" in grid:
        grid["dataset"] = [with_dataset_options(d, {f"dataset.{k}": v for k, v in SMALL.items()}) for d in grid["dataset"]]
    return replace(spec, base=base, grid=grid, **{"cpus_per_shard": 0.5, "driver_cpus": 0.5, **resources})


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_the_participation_sweep_runs_and_tables_every_evaluation(ray_session, tmp_path):
    spec = small(load_sweep(SWEEPS / "participation.yaml"))
    spec = replace(spec, base={**spec.base, "eval_every": 5}, grid={**spec.grid, "clients_per_round": [20, 50]})
    before = set(actors())
    table = sweep(spec, tmp_path, quiet=True)
    started = Counter(actor["ActorClassName"] for key, actor in actors().items() if key not in before)
    assert table.equals(pl.read_parquet(tmp_path / "participation" / RESULTS))
    per_trial = table.group_by("trial_id").agg(pl.col("method").first(), pl.col("clients_per_round").first(), pl.col("round").max(), pl.len())
    assert per_trial.height == 6
    assert started["ImplicitFunc"] < 6 and started["ShardActor"] < 6, f"a finished trial's process and shards run the next: {started}"
    clients = load_federation(spec.base["dataset"]).num_clients
    for row in per_trial.iter_rows(named=True):
        rounds = -(-clients // row["clients_per_round"])
        assert row["round"] == rounds and row["len"] == len(set(range(5, rounds + 1, 5)) | {rounds})
    final = table.filter(pl.col("round") == pl.col("round").max().over("trial_id"))
    assert (final["clients_seen"] == clients).all()
    assert set(table["num_shards"]) == {1} and (table["sweep"] == "participation").all()
    accuracy = dict(final.group_by("method").agg(pl.col("accuracy").min()).iter_rows())
    assert accuracy["fedncm"] < accuracy["fed3r"] and accuracy["fedncm"] < accuracy["fedcof"]


@pytest.mark.slow
def test_fed3r_is_immune_to_the_split_in_the_heterogeneity_sweep(ray_session, tmp_path):
    spec = small(load_sweep(SWEEPS / "heterogeneity.yaml"), shards_per_trial=2, cpus_per_shard=0.5, driver_cpus=1)
    spec = replace(spec, base={**spec.base, "clients_per_round": 2}, grid={**spec.grid, "method": ["fed3r"]})
    table = sweep(spec, tmp_path, quiet=True)
    final = table.filter(pl.col("round") == pl.col("round").max().over("trial_id"))
    assert final.height == 4 and final["dataset"].n_unique() == 4 and set(table["num_shards"]) == {2}
    assert final["accuracy"].n_unique() == 1, final.select("dataset", "accuracy")


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_the_dirichlet_sweep_sets_alpha_in_the_dataset(ray_session, tmp_path):
    spec = small(load_sweep(SWEEPS / "dirichlet.yaml"))
    spec = replace(spec, grid={"dataset.alpha": [0.01, 100.0], "method": ["fed3r"]})
    table = sweep(spec, tmp_path, quiet=True)
    assert sorted(table["dataset.alpha"].unique()) == [0.01, 100.0]
    for alpha, dataset in table.select("dataset.alpha", "dataset").unique().iter_rows():
        assert f"alpha={alpha:g}" in dataset.replace("alpha=100.0", "alpha=100")


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_resumed_sweep_runs_only_the_unfinished_trials(ray_session, tmp_path):
    features = tmp_path / "later.parquet"
    tiny = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"
    path = write(tmp_path, f"""
name: resumable
base: {{clients_per_round: 10, eval_every: 3, method: fed3r}}
grid:
  dataset: ["{tiny}", "parquet:{features}"]
cpus_per_shard: 0.5
driver_cpus: 0.5
""")
    with pytest.raises(FedrayError, match="1 of 2 trials failed") as failure:
        sweep(load_sweep(path), tmp_path / "out", quiet=True)
    assert f"(first: {features}: no such file)" in str(failure.value), "fedray's message, not Ray's actor line"
    assert "\x1b" not in str(failure.value) and "ray::" not in str(failure.value)
    first = pl.read_parquet(tmp_path / "out" / "resumable" / RESULTS)
    assert first["trial_id"].n_unique() == 1
    with pytest.raises(FedrayError, match="already there"):
        sweep(load_sweep(path), tmp_path / "out", quiet=True)
    export_parquet(load_federation(tiny), features)
    stale = tmp_path / "out" / "resumable" / f".{RESULTS}.ab12cd34.tmp"
    stale.write_bytes(b"what an interrupted write left")
    table = sweep(load_sweep(path), tmp_path / "out", resume=True, quiet=True)
    assert table["trial_id"].n_unique() == 2
    assert not stale.exists(), "the resumed sweep removes its own stale temporary"
    assert table.filter(pl.col("trial_id") == first["trial_id"][0]).equals(first), "not run again: same wall_s too"
    finals = table.filter(pl.col("round") == pl.col("round").max().over("trial_id"))
    assert finals["accuracy"].n_unique() == 1, "the same data, as synthetic or as exported Parquet, gives the same Fed3R"


@pytest.mark.parametrize("text, message", [
    ("name: x\nbase: {lam: 0.1}\ngrid: {lam: [1, 2]}\n", "lam given in more than one"),
    ("name: x\ngrid: {method: []}\n", "grid.method must be a non-empty list"),
    ("name: x\ngrid: {num_shards: [1, 2]}\n", "grid.num_shards is the sweep's to set: shards_per_trial"),
    ("name: x\ngrid: {colour: [1]}\n", "grid.colour is not a run option"),
    ("name: x\ngrid: {dataset.colour: [1]}\n", "unknown dataset option 'colour'"),
    ("name: x\nrandom: {lam: {normal: [0, 1]}}\n", "random.lam must be one of"),
    ("name: x\nrandom: {lam: {loguniform: [0, 1]}}\n", "0 < low < high"),
    ("name: x\nrandom: {lam: {uniform: [0.1]}}\n", r"needs \[low, high\]"),
    ("name: x\ngrid: {eval_every: [1, two]}\n", "eval_every must be an integer"),
    ("name: x y\n", "name must be a word"),
    ("name: x\nshards: 2\n", "unknown key"),
    ("name: x\nshards_per_trial: 0\n", "shards_per_trial must be an integer ≥ 1"),
    ("name: x\nbase: {lam: .inf}\n", "option lam must be a finite number"),
    ("name: x\ngrid: {gamma: [0.1, .nan]}\n", "option gamma must be a finite number"),
    ("name: x\ngrid: {seed: [0, -1]}\n", "option seed must be an integer from 0"),
    ("name: x\nrandom: {lam: {uniform: [0.1, .inf]}}\n", "option lam must be a finite number"),
    ("name: x\ngrid: {dataset.alpha: [0.1, .nan]}\n", "dataset.alpha must be a finite number"),
    ("name: x\ngrid: {dataset.split_seed: [-3]}\n", "dataset.split_seed must be an integer from 0"),
    ("name: x\ncpus_per_shard: .nan\n", "cpus_per_shard must be a finite number"),
    ("name: x\ngpus_per_shard: -1\n", "gpus_per_shard must be a number ≥ 0"),
    ("name: x\ngpus_per_shard: yes\n", "gpus_per_shard must be a number ≥ 0"),
    ("- name\n- x\n", "a sweep file is a mapping"),
    ("name: [x\n", "not valid YAML"),
])
def test_bad_sweep_files_are_named(tmp_path, text, message):
    with pytest.raises(FedrayError, match=message):
        load_sweep(write(tmp_path, text))


def test_a_binary_sweep_file_is_named(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(FedrayError) as error:
        load_sweep(path)
    assert str(error.value) == f"{path}: not a text file (byte 0x89 at offset 0 is not UTF-8); a sweep file is YAML"


def test_a_missing_sweep_file_is_named(tmp_path):
    with pytest.raises(FedrayError, match="nothing.yaml: no such sweep file"):
        load_sweep(tmp_path / "nothing.yaml")


TINY = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"
DOOMED = [
    ("base: {method: fed3r}\ngrid: {lam: [-1, 0.01]}\n", "1 of 2 option combinations would fail, first lam=-1.0: --lam must be > 0, got -1.0"),
    ("grid: {method: [fedncm, fed3r], dataset.alpha: [0.1, 1]}\n",
     "4 of 4 option combinations would fail, first method=fedncm, dataset.alpha=0.1: dataset 'synthetic:inat-user-120k?"
     "alpha=0.1&classes=20&dim=8&scale=0.02': option(s) alpha need split=dirichlet|dirichlet_per_class|classes"),
    ("base: {method: fed3r}\nrandom: {lam: {uniform: [-1, 1]}}\n", "first lam=-1.0: --lam must be > 0, got -1.0"),
    ("base: {method: fedavg}\nrandom: {server_lr: {choice: [0.5, 0]}}\n", "first server_lr=0.0: --server-lr must be > 0"),
    ("base: {method: fedavg, init: fedcof}\ngrid: {gamma: [0.1, -1]}\n", "first gamma=-1.0: --gamma must be ≥ 0, got -1.0"),
    ("grid: {dataset.scale: [0.5, 2]}\n", "first dataset.scale=2.0: synthetic:inat-user-120k: scale must be in (0, 1], got 2.0"),
    ("grid: {dataset.split: [classes], dataset.clients: [5]}\n", "split=classes needs classes_per_client=C"),
    ("base: {method: fed3r, lam: 0}\n", "sweep doomed: its trials would fail: --lam must be > 0, got 0.0"),
    ("grid: {method: [fedncm, fedcof], lam: [0.1, 1]}\n", "sweep doomed: none of its trials uses lam: --lam applies to "
     "fed3r, fed3r-rf, ffc (closed-form methods), not to this run (--method fedncm)"),
    ("base: {method: fedavg}\ngrid: {options.server_momentum: [0.5, 0.9]}\n", "none of its trials uses server_momentum: "
     "--server-momentum applies to fedavgm (server optimizer), not to this run (--method fedavg with server optimizer fedavg)"),
]


def test_an_option_of_the_sweep_is_left_at_its_default_in_the_trials_it_does_not_apply_to(tmp_path):
    spec = load_sweep(write(tmp_path, f"name: mixed\nbase: {{dataset: '{TINY}', lam: 0.5}}\ngrid: {{method: [fedncm, fed3r]}}\n"))
    check_trials(spec)  # lam applies to fed3r's trials: the sweep is not refused
    fedncm, fed3r = (trial_config({**spec.base, "method": method}, out=str(tmp_path / method)) for method in ("fedncm", "fed3r"))
    assert (fedncm.lam, fed3r.lam) == (0.01, 0.5)
    assert "lam" not in fedncm.metrics_columns() and fed3r.metrics_columns()["lam"] == 0.5


@pytest.mark.parametrize("text, message", DOOMED)
def test_trials_that_would_fail_on_their_options_are_refused_before_tune_starts(tmp_path, text, message):
    path = write(tmp_path, f"name: doomed\n{text}")
    spec = load_sweep(path)
    spec = replace(spec, base={"dataset": TINY, **spec.base})
    with pytest.raises(FedrayError) as refusal:
        sweep(spec, tmp_path / "out", quiet=True)
    assert message in str(refusal.value) and str(refusal.value).startswith("sweep doomed: ")
    assert not (tmp_path / "out").exists(), "refused before Tune wrote anything"


def test_the_command_line_refuses_a_doomed_sweep_in_one_line(tmp_path, capsys):
    path = write(tmp_path, f"name: doomed\nbase: {{dataset: '{TINY}', method: fed3r}}\ngrid: {{lam: [-1, 0.01]}}\n")
    assert main(["sweep", "--config", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == "fedray: error: sweep doomed: 1 of 2 option combinations would fail, first lam=-1.0: --lam must be > 0, got -1.0\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_when_every_trial_fails_the_sweep_says_so_and_writes_no_results(ray_session, tmp_path):
    missing = tmp_path / "missing.parquet"
    path = write(tmp_path, f"""
name: hopeless
base: {{clients_per_round: 10, method: fed3r}}
grid:
  dataset: ["parquet:{missing}", "parquet:{missing}?split=classes&clients=5&classes_per_client=2"]
cpus_per_shard: 0.5
driver_cpus: 0.5
""")
    with pytest.raises(FedrayError) as failure:
        sweep(load_sweep(path), tmp_path / "out", quiet=True)
    assert str(failure.value).startswith(f"all 2 trials failed (first: {missing}: no such file), so no {RESULTS}; ")
    assert "\x1b" not in str(failure.value)
    assert not (tmp_path / "out" / "hopeless" / RESULTS).exists()


def test_a_trial_holds_its_shards_gpus(tmp_path):
    spec = load_sweep(write(tmp_path, "name: x\nshards_per_trial: 2\ncpus_per_shard: 2\ngpus_per_shard: 0.5\n"))
    assert spec.bundles == [{"CPU": 1.0}, {"CPU": 2, "GPU": 0.5}, {"CPU": 2, "GPU": 0.5}]
    assert load_sweep(write(tmp_path, "name: x\n")).bundles == [{"CPU": 1.0}, {"CPU": 1.0}]


@pytest.mark.parametrize("resources, asked", [
    ({"gpus_per_shard": 1}, r"driver \(1 CPU\) and 1 shards × \{'CPU': 1.0, 'GPU': 1\}"),
    ({"shards_per_trial": 2, "driver_cpus": 0.5}, r"driver \(0.5 CPU\) and 2 shards × \{'CPU': 1.0\}"),  # 2.5 CPUs
])
def test_a_trial_the_cluster_can_never_hold_is_refused_before_tune_starts(ray_session, tmp_path, resources, asked):
    """The test session's Ray has 2 CPUs, no GPU and no autoscaler: Tune would wait for these trials forever."""
    spec = SweepSpec("big", base={"dataset": TINY, "method": "fed3r"}, **resources)
    with pytest.raises(FedrayError, match=rf"cannot reserve one trial's {asked}: the cluster has 2 CPU, 0 GPU, .* "
                                          r"lower driver_cpus, shards_per_trial, cpus_per_shard or gpus_per_shard"):
        sweep(spec, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()


def test_a_failed_trial_is_named_by_its_own_error():
    coloured = RuntimeError("\x1b[31mshard lost\x1b[39m\n  more detail")
    assert failure_line(coloured) == "RuntimeError: shard lost"
    assert failure_line(FedrayError("--lam must be > 0, got -1.0")) == "--lam must be > 0, got -1.0"


def test_a_trial_takes_an_owned_option_swept_under_options_as_its_run_option():
    """``options.prox_mu: [...]`` in a sweep is ``prox_mu: [...]``: FedProx's μ, the run option --prox-mu."""
    swept = trial_config({"method": "fedprox", "options.prox_mu": 0.3}, out="trial")
    assert swept == trial_config({"method": "fedprox", "prox_mu": 0.3}, out="trial")
    assert (swept.prox_mu, swept.options) == (0.3, {})


def test_base_options_as_a_mapping_are_the_trials_plugin_options(tmp_path):
    """``base: {options: {x: 1}}``, as a config file writes it, is ``base: {options.x: 1}``."""
    noise = f"{Path(__file__).resolve().parents[2] / 'examples' / 'gaussian_noise.py'}:GaussianNoise"
    spec = load_sweep(write(tmp_path, f"name: x\nbase: {{method: fedprox, postprocessor: '{noise}', "
                                      f"options: {{prox_mu: 0.3, noise_std: 0.5}}}}\n"))
    assert spec.base == {"method": "fedprox", "postprocessor": noise, "options.prox_mu": 0.3, "options.noise_std": 0.5}
    trial = trial_config(spec.base, out="trial")
    assert (trial.prox_mu, trial.options) == (0.3, {"clip": None, "noise_std": 0.5})  # resolved: defaults added


@pytest.mark.parametrize("text, message", [
    ("grid: {options: {x: [1, 2]}}", "grid.options: sweep each plugin option as its own key, grid.options.NAME"),
    ("base: {options: [1]}", "base: options must be a mapping of option: value, got [1]"),
    ("base: {options: {x: 1}, options.x: 2}", "base.options.x is given twice: in base.options and as base.options.x"),
])
def test_bad_plugin_options_in_a_sweep_are_one_line(tmp_path, text, message):
    path = write(tmp_path, f"name: x\n{text}\n")
    with pytest.raises(FedrayError, match=f"^{re.escape(f'{path}: {message}')}$"):
        load_sweep(path)


def test_the_results_table_carries_each_trials_clock_columns(tmp_path):
    """A deadline sweep's trials ran on the clock, a trial without one beside them: results.parquet has every trial's
    clock_s, its split and its stragglers per row (null in the trial without a clock), and the swept deadline."""
    clocked = {"clock_s": [60.0, 120.0], "clock_compute_s": [50.0, 100.0], "clock_comm_s": [10.0, 20.0],
               "clients_straggled": [1, 3], "clients_dropped": [0, 1]}
    trials = {"t0": {"deadline": [30, 30], **clocked},
              "t1": {"deadline": [90, 90], **clocked, "clients_straggled": [0, 0]}, "t2": {}}
    grid = []
    for trial, columns in trials.items():
        (tmp_path / trial).mkdir()
        pl.DataFrame({"method": "fedavg", "round": [1, 2], "accuracy": [0.2, 0.4], **columns}).write_parquet(
            tmp_path / trial / "metrics.parquet")
        grid.append(SimpleNamespace(path=str(tmp_path / trial), metrics={"trial_id": trial}, config={}, error=None))
    table = combine(SimpleNamespace(name="deadline", swept=["deadline"]), grid)
    assert table.select("trial_id", "round", "deadline", "clock_s", "clock_compute_s", "clock_comm_s",
                        "clients_straggled", "clients_dropped").rows() == [
        ("t0", 1, 30, 60.0, 50.0, 10.0, 1, 0), ("t0", 2, 30, 120.0, 100.0, 20.0, 3, 1),
        ("t1", 1, 90, 60.0, 50.0, 10.0, 0, 0), ("t1", 2, 90, 120.0, 100.0, 20.0, 0, 1),
        ("t2", 1, None, None, None, None, None, None), ("t2", 2, None, None, None, None, None, None)]


def test_what_made_a_trial_is_typed_columns_null_for_a_trial_without_run_json(tmp_path):
    """A resumed sweep's trials an earlier fedray ran have no run.json: their env_ columns are null, typed as the
    others' (so the trials' tables combine)."""
    (tmp_path / "run.json").write_text('{"fedray": "0.1.0", "dirty": false, "nodes": 2, "cpus_per_shard": 0.5}')
    recorded, earlier = (pl.DataFrame({"round": [1]}).with_columns(_environment_columns(tmp_path / name))
                         for name in ("run.json", "absent.json"))
    assert recorded.columns == earlier.columns == ["round", *(f"env_{name}" for name in FIELDS)]
    assert recorded.schema == earlier.schema
    assert [recorded.schema[f"env_{name}"] for name in ("dirty", "nodes", "cpus_per_shard")] == \
        [pl.Boolean, pl.Int64, pl.Float64]
    assert recorded.select("env_fedray", "env_dirty", "env_nodes", "env_cpus_per_shard", "env_torch").row(0) == \
        ("0.1.0", False, 2, 0.5, None)
    assert earlier.drop("round").row(0) == (None,) * len(FIELDS)
