"""A researcher's own method, server optimizer and training algorithm, each one file outside the package, run everywhere
a built-in runs.

The examples in ``examples/`` are the plugins: ``nearest_class_mean.py`` re-implements FedNCM,
``fedyogi.py`` is FedYogi, ``proximal_client.py`` FedProx's proximal term. A plain-averaging server optimizer is written below into a file of its own.
"""

import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
import yaml

import fedray
from fedray.app.cli import main
from fedray.core.errors import FedrayError
from fedray.core.options import options_of
from fedray.core.plugins import load_class, plugin_failure
from fedray.app.sweeps.spec import load_sweep
from fedray.app.sweeps.tuning import sweep

REPO = Path(__file__).resolve().parents[2]
NCM = f"{REPO / 'examples' / 'nearest_class_mean.py'}:NearestClassMean"
YOGI = f"{REPO / 'examples' / 'fedyogi.py'}:FedYogi"
PROXIMAL = f"{REPO / 'examples' / 'proximal_client.py'}:Proximal"
SPEC = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"
SMALL_RUN = ["--num-shards", "2", "--cpus-per-shard", "0.5", "--quiet"]
PLAIN_AVERAGE = '''
import fedray


class PlainAverage(fedray.ServerOptimizer):
    """θ + Δ, nothing else."""

    def step(self, params, delta):
        return {name: params[name] + change for name, change in delta.items()}
'''


def cli(capsys, *args):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def weight(out: Path) -> np.ndarray:
    with np.load(out / "classifier.npz") as arrays:
        return arrays["W"]


def rows(out: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in pq.read_table(out / "metrics.parquet").to_pylist()]


def max_relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def fedncm_run(ray_session, tmp_path_factory):
    out = tmp_path_factory.mktemp("fedncm")
    assert main(["run", "--method", "fedncm", "--dataset", SPEC, "--out", str(out), "--eval-every", "3", *SMALL_RUN]) == 0
    return out


def test_a_closed_form_plugin_on_the_command_line_gives_the_builtin_classifier(fedncm_run, tmp_path, capsys):
    rc, out, err = cli(capsys, "run", "--method", NCM, "--dataset", SPEC, "--out", tmp_path, "--eval-every", "3", *SMALL_RUN)
    assert rc == 0, err
    assert max_relative_difference(weight(tmp_path), weight(fedncm_run)) <= 1e-12
    plugin, builtin = rows(tmp_path), rows(fedncm_run)
    assert [r["accuracy"] for r in plugin] == [r["accuracy"] for r in builtin]
    assert [r["bytes_up"] for r in plugin] == [r["bytes_up"] for r in builtin]  # its upload_floats: FedNCM's M·d
    assert {(r["method"], r["method_spec"], r["normalize"]) for r in plugin} == {("NearestClassMean", NCM, True)}
    assert "lam" not in plugin[0] and "method_spec" not in builtin[0]  # fed3r's options are not a plugin's


def test_a_plugin_option_from_the_command_line_and_a_config_file(fedncm_run, tmp_path, capsys):
    rc, _, err = cli(capsys, "run", "--method", NCM, "--dataset", SPEC, "--out", tmp_path / "cli", "--option",
                     "normalize=false", *SMALL_RUN)
    assert rc == 0, err
    config = yaml.safe_load((tmp_path / "cli" / "config.yaml").read_text())
    assert config["options"] == {"normalize": False} and config["method"] == NCM
    # the unnormalized means, written out: column c is the mean of class c's training features
    federation = fedray.load_federation(SPEC)
    sample_ids, labels, _ = federation.train_arrays(0, federation.num_clients)
    features = federation.source.features("train", sample_ids).double()
    means = np.stack([features[labels == c].mean(0).numpy() for c in range(federation.num_classes)], axis=1)
    assert max_relative_difference(weight(tmp_path / "cli"), means) <= 1e-12
    # the same run from its config.yaml; then the file's option overridden on the command line
    rc, _, err = cli(capsys, "run", "--config", tmp_path / "cli" / "config.yaml", "--out", tmp_path / "yaml")
    assert rc == 0, err
    assert np.array_equal(weight(tmp_path / "yaml"), weight(tmp_path / "cli"))
    rc, _, err = cli(capsys, "run", "--config", tmp_path / "cli" / "config.yaml", "--out", tmp_path / "over",
                     "--option", "normalize=true")
    assert rc == 0, err
    assert max_relative_difference(weight(tmp_path / "over"), weight(fedncm_run)) <= 1e-12


def test_a_closed_form_plugin_from_python(fedncm_run, tmp_path):
    plugin = load_class(NCM, fedray.ClosedFormMethod, {}, "method")
    table = fedray.run(method=plugin, dataset=SPEC, out=tmp_path, eval_every=3, num_shards=2, cpus_per_shard=0.5,
                       quiet=True).metrics
    assert isinstance(table, pl.DataFrame) and table["accuracy"].to_list() == [r["accuracy"] for r in rows(fedncm_run)]
    assert max_relative_difference(weight(tmp_path), weight(fedncm_run)) <= 1e-12


@pytest.mark.slow
def test_a_closed_form_plugin_in_a_sweep(fedncm_run, tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "name": "plugin", "base": {"dataset": SPEC, "method": NCM, "eval_every": 3},
        "grid": {"options.normalize": [True, False]}, "cpus_per_shard": 0.5, "driver_cpus": 0.5,
    }))
    table = sweep(load_sweep(path), tmp_path / "out", quiet=True)
    assert sorted(table["normalize"].unique().to_list()) == [False, True]
    trial = table.filter(pl.col("normalize")).select("trial_id").row(0)[0]
    folder = next(p for p in (tmp_path / "out" / "plugin").iterdir() if p.is_dir() and trial in p.name)
    assert max_relative_difference(weight(folder), weight(fedncm_run)) <= 1e-12


def test_a_server_optimizer_plugin_of_theta_plus_delta_is_fedavg_bit_for_bit(ray_session, tmp_path, capsys):
    (tmp_path / "plain_average.py").write_text(PLAIN_AVERAGE)
    common = ["--method", "fedavg", "--dataset", SPEC, "--rounds", "12", "--eval-every", "4", "--client-lr", "0.01", *SMALL_RUN]
    assert cli(capsys, "run", *common, "--out", tmp_path / "builtin")[0] == 0
    rc, out, err = cli(capsys, "run", *common, "--out", tmp_path / "plugin", "--server-optimizer",
                       f"{tmp_path / 'plain_average.py'}:PlainAverage")
    assert rc == 0, err
    assert out.startswith(f"fedavg with server optimizer PlainAverage on {SPEC}: test accuracy "), out  # what ran
    plugin_rows = rows(tmp_path / "plugin")
    assert {(r["server_optimizer"], r["server_optimizer_spec"]) for r in plugin_rows} == \
        {("PlainAverage", f"{tmp_path / 'plain_average.py'}:PlainAverage")}
    drop = ("server_optimizer", "server_optimizer_spec")
    assert [{k: v for k, v in r.items() if k not in drop} for r in rows(tmp_path / "plugin")] == \
        [{k: v for k, v in r.items() if k not in drop} for r in rows(tmp_path / "builtin")]
    with np.load(tmp_path / "plugin" / "classifier.npz") as plugin, np.load(tmp_path / "builtin" / "classifier.npz") as builtin:
        assert np.array_equal(plugin["W"], builtin["W"]) and np.array_equal(plugin["bias"], builtin["bias"])


FLOAT64_NCM = '''
import torch
import fedray


class Float64NCM(fedray.ClosedFormMethod):
    """FedNCM on float64 features, summed as handed over (no conversion): the shards and the upload count's probe
    both give float64."""

    features_dtype = torch.float64

    def client_statistics(self, batch):
        counts = torch.bincount(batch.labels, minlength=self.num_classes).double()
        sums = torch.zeros(self.num_classes, self.dim, dtype=torch.float64).index_add_(0, batch.labels, batch.features)
        return counts, sums

    def combine(self, a, b):
        return a[0] + b[0], a[1] + b[1]

    def solve(self, stats):
        means = (stats[1] / stats[0].clamp(min=1)[:, None]).T
        return fedray.Classifier(torch.nn.functional.normalize(means, dim=0))
'''


def test_a_float64_plugin_runs_with_the_default_upload_count(fedncm_run, tmp_path, capsys):
    (tmp_path / "float64_ncm.py").write_text(FLOAT64_NCM)
    rc, _, err = cli(capsys, "run", "--method", f"{tmp_path / 'float64_ncm.py'}:Float64NCM", "--dataset", SPEC,
                     "--out", tmp_path / "out", "--eval-every", "3", *SMALL_RUN)
    assert rc == 0, err
    assert max_relative_difference(weight(tmp_path / "out"), weight(fedncm_run)) <= 1e-12
    dim, classes = 8, 20  # the default count: one client's statistics, C counts and C × d sums, as float32
    assert rows(tmp_path / "out")[-1]["bytes_up"] == rows(tmp_path / "out")[-1]["clients_seen"] * (classes + classes * dim) * 4


def test_a_plugins_own_error_is_named_above_its_traceback(tmp_path, capsys):
    broken = FLOAT64_NCM.replace("    def combine(self, a, b):", "    def combine(self, a, b):\n        raise ZeroDivisionError('my bug')")
    (tmp_path / "broken.py").write_text(broken)
    plugin = load_class(f"{tmp_path / 'broken.py'}:Float64NCM", fedray.ClosedFormMethod, {}, "method")
    with pytest.raises(ZeroDivisionError) as raised:
        plugin(2, 2).combine(None, None)
    assert plugin_failure(raised.value) == \
        f"the plugin {tmp_path / 'broken.py'}:Float64NCM failed in combine (ZeroDivisionError: my bug)"
    assert plugin_failure(ZeroDivisionError("fedray's own")) is None


def test_a_plugins_error_in_a_shard_is_named_above_its_traceback(ray_session, tmp_path, capsys):
    broken = FLOAT64_NCM.replace("    def client_statistics(self, batch):",
                                 "    def client_statistics(self, batch):\n        if len(batch.labels) > 1:\n"
                                 "            raise KeyError('a bug in a shard')")
    (tmp_path / "broken.py").write_text(broken)
    rc, _, err = cli(capsys, "run", "--method", f"{tmp_path / 'broken.py'}:Float64NCM", "--dataset", SPEC,
                     "--out", tmp_path / "out", *SMALL_RUN)
    first, *traceback = err.splitlines()
    assert rc == 1 and first == f"fedray: error: the plugin {tmp_path / 'broken.py'}:Float64NCM failed in " \
        "client_statistics (KeyError: 'a bug in a shard'); its traceback:", err
    assert traceback[0] == "Traceback (most recent call last):"
    assert f'File "{tmp_path / "broken.py"}", line 14, in client_statistics' in err and "KeyError: 'a bug in a shard'" in err
    assert not (tmp_path / "out" / "metrics.parquet").exists()


@pytest.mark.parametrize("form", ["file", "module"])
def test_a_folder_named_fedray_that_hides_the_package_is_named(tmp_path, monkeypatch, form):
    """As in a Ray worker started in a folder holding a ``fedray/`` folder: ``import fedray`` gives that folder (a
    namespace package, ahead of an editable install) while fedray's submodules still load."""
    (tmp_path / "fedray").mkdir()
    (tmp_path / "shadowed_plugin.py").write_text("import fedray\n\n\nclass Mine(fedray.ClosedFormMethod):\n    pass\n")
    monkeypatch.delitem(sys.modules, "fedray")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    spec = f"{tmp_path / 'shadowed_plugin.py'}:Mine" if form == "file" else "shadowed_plugin:Mine"
    with pytest.raises(FedrayError) as error:
        load_class(spec, fedray.ClosedFormMethod, {}, "method")
    assert str(error.value).endswith(
        f"(AttributeError: module 'fedray' has no attribute 'ClosedFormMethod'): 'import fedray' gave {tmp_path / 'fedray'} "
        f"(a folder without __init__.py, imported as a namespace package), not fedray's package {REPO / 'fedray'}: a folder "
        "named fedray in the working directory or on sys.path hides it; rename or move that folder"), error.value


def test_fedyogi_follows_its_update_rule():
    yogi = load_class(YOGI, fedray.ServerOptimizer, {}, "server optimizer")(server_lr=0.05, yogi_tau=1e-2)
    deltas = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5]), torch.tensor([-1.0, 4.0])]
    theta, m, v = torch.tensor([0.0, 1.0]), torch.zeros(2), torch.full((2,), 1e-4)  # v starts at τ²
    params = {"w": theta.clone()}
    for delta in deltas:
        m = 0.9 * m + 0.1 * delta
        v = v - 0.01 * delta**2 * torch.sign(v - delta**2)
        theta = theta + 0.05 * m / (v.sqrt() + 1e-2)
        params = yogi.step(params, {"w": delta})
        torch.testing.assert_close(params["w"], theta, rtol=0, atol=1e-7)
    assert [o.name for o in options_of(type(yogi)).values()] == ["server_lr", "yogi_beta1", "yogi_beta2", "yogi_tau"]


@pytest.mark.slow
def test_fedyogi_trains_through_the_shards_and_in_a_sweep_with_a_plugin_algorithm(ray_session, tmp_path, capsys):
    rc, _, err = cli(capsys, "run", "--method", "scaffold", "--server-optimizer", YOGI, "--dataset", SPEC, "--rounds", "6",
                     "--eval-every", "3", "--client-lr", "0.01", "--option", "yogi_tau=0.01", "--out", tmp_path / "run", *SMALL_RUN)
    assert rc == 0, err
    run_rows = rows(tmp_path / "run")
    assert [r["round"] for r in run_rows] == [0, 3, 6] and {r["yogi_tau"] for r in run_rows} == {0.01}
    assert {(r["server_optimizer"], r["server_optimizer_spec"], r["server_lr"]) for r in run_rows} == {("FedYogi", YOGI, 0.01)}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "name": "yogi", "base": {"dataset": SPEC, "method": PROXIMAL, "server_optimizer": YOGI, "rounds": 4, "eval_every": 2,
                                 "client_lr": 0.01, "options.mu": 0.05},
        "grid": {"options.yogi_beta2": [0.9, 0.99]}, "cpus_per_shard": 0.5, "driver_cpus": 0.5,
    }))
    table = sweep(load_sweep(path), tmp_path / "sweeps", quiet=True)
    assert sorted(table["yogi_beta2"].unique().to_list()) == [0.9, 0.99] and table["trial_id"].n_unique() == 2
    assert set(table["method"]) == {"Proximal"} and set(table["method_spec"]) == {PROXIMAL}
    assert set(table["mu"]) == {0.05}


def test_a_plugin_algorithm_of_the_proximal_term_trains_as_fedprox_bit_for_bit(ray_session, tmp_path, capsys):
    """SphereFed's projection trains by autograd on both sides: the plugin's hook adds μ(θ − θ₀) as the built-in's does."""
    common = ["--head", "sphere", "--sphere-dim", "8", "--dataset", SPEC, "--rounds", "4", "--eval-every", "2",
              "--client-lr", "0.05", *SMALL_RUN]
    assert cli(capsys, "run", *common, "--method", "fedprox", "--prox-mu", "0.1", "--out", tmp_path / "builtin")[0] == 0
    rc, _, err = cli(capsys, "run", *common, "--method", PROXIMAL, "--option", "mu=0.1", "--out", tmp_path / "plugin")
    assert rc == 0, err
    plugin, builtin = rows(tmp_path / "plugin"), rows(tmp_path / "builtin")
    assert {(r["method"], r["method_spec"], r["mu"]) for r in plugin} == {("Proximal", PROXIMAL, 0.1)}
    assert all("prox_mu" not in r for r in plugin)  # the plugin takes no prox_mu: no column
    assert {(r["method"], r["prox_mu"]) for r in builtin} == {("fedprox", 0.1)}
    settings = ("method", "method_spec", "prox_mu", "mu")
    assert [{k: v for k, v in r.items() if k not in settings} for r in plugin] == \
        [{k: v for k, v in r.items() if k not in settings} for r in builtin]
    with np.load(tmp_path / "plugin" / "classifier.npz") as ours, np.load(tmp_path / "builtin" / "classifier.npz") as theirs:
        assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[key], theirs[key]) for key in ours)


def test_a_plugin_algorithm_declares_its_fields_as_options():
    proximal = load_class(PROXIMAL, fedray.FederatedAlgorithm, {}, "training algorithm")
    assert [o.describe() for o in options_of(proximal).values()] == ["mu: float = 0.01  (proximal weight μ)"]


@pytest.mark.parametrize("args, needles", [
    (["--method", "nowhere.py:Thing"], ["nowhere.py: no such plugin file"]),
    (["--method", "fedray.methods.training.server:ServerSGD"], ["not a subclass of fedray.ClosedFormMethod"]),
    (["--method", f"{REPO / 'examples' / 'nearest_class_mean.py'}:Missing"], ["no class 'Missing'"]),
    (["--method", "no_such_module_here:Thing"], ["cannot import no_such_module_here"]),
    (["--method", NCM, "--option", "normalise=false"], ["unknown option(s) normalise", "normalize"]),
    (["--method", NCM, "--option", "normalize=maybe"], ["option normalize must be true or false"]),
    (["--method", NCM, "--option", "novalue"], ["--option takes key=value"]),
    (["--method", NCM, "--option", "client_lr=1"], ["client_lr is a run option: use --client-lr"]),
    (["--method", "fed3r", "--lam", "1", "--option", "lam=2"], ["lam is given twice: as --lam and as --option lam"]),
    (["--method", "fedprox", "--option", "prox_mu=strong"], ["--option prox_mu: option prox_mu must be a number"]),
    (["--method", "fed3r", "--server-optimizer", YOGI], ["--server-optimizer applies to gradient methods"]),
    (["--method", "fedavg", "--server-optimizer", NCM], ["not a subclass of fedray.ServerOptimizer"]),
    (["--method", "fedadam", "--server-optimizer", YOGI],
     [f"--method fedadam is its own server optimizer (fedadam): --server-optimizer {YOGI} contradicts it"]),
    (["--method", "fedavgm", "--server-optimizer", "fedavg"],
     ["--method fedavgm is its own server optimizer (fedavgm): --server-optimizer fedavg contradicts it"]),
    (["--method", "tct", "--base", "fedadam", "--server-optimizer", YOGI], ["--base fedadam is its own server optimizer"]),
    (["--method", PROXIMAL, "--option", "mu=strong"], ["option mu must be a number"]),
    (["--method", "fedcof", "--postprocessor", "count-noise", "--option", "count_noise=laplace"],
     ["--postprocessor count-noise: option count_noise_epsilon is required"]),
    (["--method", "fedavg", "--client-algorithm", PROXIMAL],
     ["--client-algorithm was removed: write your client's loss or gradient correction as a fedray.FederatedAlgorithm "
      "subclass and give it as --method FILE.py:Class (see examples/proximal_client.py)"]),
])
def test_bad_plugins_and_options_are_one_line_errors_before_any_work(capsys, tmp_path, args, needles):
    rc, out, err = cli(capsys, "run", "--dataset", SPEC, "--out", tmp_path / "out", *SMALL_RUN, *args)
    assert rc == 2 and err.startswith("fedray: error: ") and err.count("\n") == 1, err
    assert all(needle in err for needle in needles), err
    assert not (tmp_path / "out").exists()


def test_methods_lists_every_builtin_with_its_options(capsys):
    rc, out, err = cli(capsys, "methods")
    assert rc == 0, err
    for line in ["fed3r", "lam: float = 0.01", "bias: bool = False", "fed3r-rf", "rf_sigma: float | None = None",
                 "fedcof", "gamma: float = 0.1", "means_per_class: int = 1", "between_class: bool = False", "fedncm",
                 "distance: str = 'cosine'", "ffc", "fedcof-oracle", "covariance: str = 'full'", "ccvr",
                 "virtual_per_class: int = 100",
                 "fedavg", "fedadam", "server_lr: float | None = None", "adam_beta2: float = 0.99",
                 "fedavgm", "server_momentum: float = 0.9", "scaffold", "fedprox", "tct",
                 "count-noise", "count_noise: str = 'laplace'", "count_noise_epsilon: float | None = None"]:
        assert line in out, line


def test_methods_prints_a_plugins_kind_and_options_with_types_defaults_and_help(capsys):
    noise = f"{REPO / 'examples' / 'gaussian_noise.py'}:GaussianNoise"
    rc, out, err = cli(capsys, "methods", YOGI, noise, "fedprox")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == f"  {YOGI}: a server optimizer (--server-optimizer {YOGI})"
    assert lines[1:5] == ["      server_lr: float | None = None  (server learning rate η (default 0.01))",
                          "      yogi_beta1: float = 0.9  (β₁)", "      yogi_beta2: float = 0.99  (β₂)",
                          "      yogi_tau: float = 0.001  (τ, the adaptivity floor)"]
    assert lines[6] == f"  {noise}: a postprocessor (--postprocessor {noise})"
    assert lines[7] == "      clip: float | None = None  (clip each client's upload to this L2 norm (none: no clipping))"
    assert lines[-1] == "      prox_mu: float = 0.01  (proximal weight μ)"


@pytest.mark.parametrize("spec, message", [
    ("nope", "fedray methods: unknown class 'nope'; give a built-in's name (fedray methods lists them) or your own as "
             "path/to/file.py:Class or module:Class"),
    ("fedray.core.plugins:FILE_MODULE", "fedray.core.plugins:FILE_MODULE: FILE_MODULE is not a subclass of any of "
     "fedray.ClosedFormMethod, fedray.FederatedAlgorithm, fedray.ServerOptimizer, fedray.Postprocessor"),
])
def test_methods_of_something_that_is_not_a_class_is_one_line(capsys, spec, message):
    assert cli(capsys, "methods", spec) == (2, "", f"fedray: error: {message}\n")


def test_the_readme_example_method_runs_and_is_fedncm(fedncm_run, tmp_path):
    """The "Write your own method" example of the manual, as written there."""
    readme = (REPO / "docs" / "plugins.md").read_text()
    code = readme.split("```python\n# my_ncm.py\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_ncm.py").write_text(code)
    table = fedray.run(method=f"{tmp_path / 'my_ncm.py'}:MyNCM", dataset=SPEC, out=tmp_path / "out", eval_every=3,
                       num_shards=2, cpus_per_shard=0.5, quiet=True).metrics
    assert table["accuracy"].to_list() == [r["accuracy"] for r in rows(fedncm_run)]
    assert max_relative_difference(weight(tmp_path / "out"), weight(fedncm_run)) <= 1e-12
