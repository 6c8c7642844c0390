"""The DP flags (--clip-norm, --dp-unit, --dp-epsilon, --dp-delta, --dp-noise, --dp-placement): run options that add
the DP postprocessor (dp for a closed-form method, dp-fedavg for a training one) after the user's own and before
secagg, with exactly their values as its options; the older --option spelling is the same run, both at once is refused,
and a run's config.yaml re-runs to the same bits."""

from pathlib import Path
from typing import Annotated

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

import fedray
from fedray.app.cli import main
from fedray.core.errors import FedrayError
from fedray.engine.config import RunConfig, resolve
from fedray.engine.plan import postprocessing
from fedray.methods import postprocessor as postprocessor_module
from fedray.methods.postprocessor import Sampling, StageUploads
from fedray.postprocessors.dp import GaussianMechanism, calibrated
from fedray.postprocessors.dp_fedavg import calibrated as calibrated_over_rounds

SPEC = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"
SMALL_RUN = ["--num-shards", "2", "--cpus-per-shard", "0.5", "--quiet", "--clients-per-round", "8", "--rounds", "6",
             "--eval-every", "3"]
FLAGS = {"clip_norm": 2.5, "dp_delta": 1e-6, "dp_noise": 1.25, "dp_placement": "distributed"}
SPELT = {name: str(value) for name, value in FLAGS.items()}
"""The flags' values as --option gives them: strings, typed by the postprocessor's declarations."""


class Mine(fedray.Postprocessor):
    """A researcher's postprocessor that takes no DP option."""


class TrainingDp(fedray.Postprocessor):
    """A stand-in for dp-fedavg (built on another branch) with the option names it shares with dp, but no dp_unit."""

    def __init__(self, clip_norm: Annotated[float | None, "R"] = None, dp_delta: Annotated[float | None, "δ"] = None,
                 dp_epsilon: Annotated[float | None, "ε"] = None, dp_noise: Annotated[float | None, "σ"] = None,
                 dp_placement: Annotated[str, "where"] = "central") -> None:
        super().__init__()
        self.values = (clip_norm, dp_delta, dp_epsilon, dp_noise, dp_placement)


@pytest.fixture
def dp_fedavg_registered(monkeypatch):
    monkeypatch.setitem(postprocessor_module.BUILT_IN, "dp-fedavg", "tests.engine.test_dp_options:TrainingDp")


@pytest.fixture
def secagg_registered(monkeypatch):
    """``secagg`` by name as pyproject.toml registers it (an install made before it was added does not list it)."""
    monkeypatch.setitem(postprocessor_module.BUILT_IN, "secagg", "fedray.postprocessors.secagg:SecureAggregation")


MINE = "tests.engine.test_dp_options:Mine"


def built(**values) -> tuple:
    return postprocessing(resolve({}, values)).postprocessors


def test_the_flags_reach_dp_exactly_as_given():
    (flagged,) = built(method="fedncm", **FLAGS)
    assert isinstance(flagged, GaussianMechanism)
    assert (flagged.clip_norm, flagged.delta, flagged.noise, flagged.placement) == (2.5, 1e-6, 1.25, "distributed")
    (budget,) = built(method="fed3r", clip_norm="0.75", dp_delta="1e-5", dp_epsilon="2")
    direct = GaussianMechanism(clip_norm=0.75, dp_delta=1e-5, dp_epsilon=2.0)
    assert (budget.clip_norm, budget.delta, budget.noise, budget.placement) == (0.75, 1e-5, direct.noise, "central")


@pytest.mark.parametrize("spelling", [{"postprocessor": "dp"}, {"postprocessor": "fedray.postprocessors.dp:GaussianMechanism"}])
def test_the_option_spelling_is_the_same_configuration_and_dp_is_added_once(spelling):
    flags = resolve({}, {"method": "fedncm", **FLAGS})
    options = resolve({}, {"method": "fedncm", **spelling, "options": dict(SPELT)})
    both = resolve({}, {"method": "fedncm", **spelling, **FLAGS})
    assert flags.postprocessor == "dp" and options.postprocessor == both.postprocessor == spelling["postprocessor"]
    for config in (options, both):
        assert {name: getattr(config, name) for name in FLAGS} == {name: getattr(flags, name) for name in FLAGS}
        # dp's options that are not flags, at their defaults
        assert config.options == flags.options == {"dp_accountant": "pld", "dp_threshold_share": 0.5,
                                                   "dp_client_samples": None}
        assert len(postprocessing(config).postprocessors) == 1


@pytest.mark.parametrize("option", ["clip_norm", "dp_delta", "dp_noise"])
def test_a_flag_and_its_option_together_are_refused_in_one_line(option):
    with pytest.raises(FedrayError, match=rf"^{option} is given twice: as --{option.replace('_', '-')} and as --option "
                                          rf"{option} \(or options: \{{{option}: \.\.\.\}}\)$"):
        resolve({}, {"method": "fed3r", **FLAGS, "options": {option: "3"}})


def test_dp_comes_after_the_users_postprocessors_and_before_secagg(secagg_registered):
    assert RunConfig(method="fed3r", clip_norm=1.0, postprocessor="count-noise",
                     secure_aggregation=True).postprocessor_specs() == ["count-noise", "dp", "secagg"]
    assert RunConfig(method="fed3r", dp_noise=0.0, postprocessor=f"count-noise,secagg,{MINE}").postprocessor_specs() \
        == ["count-noise", "dp", "secagg", MINE]
    assert RunConfig(method="fed3r").postprocessor_specs() == []
    config = resolve({}, {"method": "fed3r", "secure_aggregation": True, **FLAGS, "options": {"secagg_clip": "9"}})
    assert config.postprocessor == "dp,secagg"
    assert [type(p).__name__ for p in postprocessing(config).postprocessors] == ["GaussianMechanism", "SecureAggregation"]


def test_a_training_method_gets_dp_fedavg(dp_fedavg_registered):
    assert RunConfig(method="fedavg", dp_noise=1.0).postprocessor_specs() == ["dp-fedavg"]
    assert RunConfig(method="tct", dp_noise=1.0).postprocessor_specs() == ["dp-fedavg"]
    assert RunConfig(method="fedavg", init="fed3r", dp_noise=1.0).postprocessor_specs() == ["dp-fedavg"]
    (flagged,) = built(method="fedavg", clip_norm="0.5", dp_delta="1e-5", dp_epsilon="3", dp_placement="distributed")
    assert isinstance(flagged, TrainingDp) and flagged.values == (0.5, 1e-5, 3.0, None, "distributed")


def test_a_flag_no_postprocessor_of_the_run_takes_is_refused(dp_fedavg_registered):
    with pytest.raises(FedrayError, match=r"^--dp-unit: no postprocessor of this run takes dp_unit "
                                          r"\(--postprocessor dp-fedavg\)$"):
        resolve({}, {"method": "fedavg", "clip_norm": 1.0, "dp_delta": 1e-5, "dp_noise": 1.0, "dp_unit": "sample"})


def test_unset_dp_options_take_the_postprocessors_defaults_and_only_a_dp_run_has_their_columns(secagg_registered):
    config = resolve({}, {"method": "fedncm", "clip_norm": 1.0, "dp_delta": 1e-5, "dp_epsilon": 4.0})
    assert (config.dp_unit, config.dp_placement, config.dp_noise) == ("sample", "central", None)
    columns = config.metrics_columns()
    assert {key: columns[key] for key in ("postprocessor", "clip_norm", "dp_unit", "dp_epsilon", "dp_delta", "dp_noise",
                                          "dp_placement", "dp_accountant")} == \
        {"postprocessor": "dp", "clip_norm": 1.0, "dp_unit": "sample", "dp_epsilon": 4.0, "dp_delta": 1e-5,
         "dp_noise": None, "dp_placement": "central", "dp_accountant": "pld"}
    plain = resolve({}, {"method": "fedncm", "secure_aggregation": True, "options": {"secagg_clip": "9"}})
    assert not {"clip_norm", "dp_unit", "dp_epsilon", "dp_delta", "dp_noise", "dp_placement"} & plain.metrics_columns().keys()


def test_run_help_lists_the_dp_flags_with_the_other_upload_options(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    start = text.index("every client's upload, on its way to the server:")
    section = text[start:text.index("--secure-aggregation", start)]
    for flag in ("--postprocessor", "--clip-norm R", "--dp-unit {sample,client}", "--dp-epsilon EPSILON",
                 "--dp-delta DELTA", "--dp-noise SIGMA", "--dp-placement {central,distributed}"):
        assert flag in section, flag


def cli_run(capsys, out: Path, *args: str) -> tuple[list[dict], dict[str, np.ndarray]]:
    """``fedray run ARGS`` in-process: its rows (less wall-clock times) and classifier.npz."""
    assert main(["run", "--out", str(out), *args]) == 0, capsys.readouterr().err
    rows = pq.read_table(out / "metrics.parquet").drop(["wall_s"]).to_pylist()
    return rows, dict(np.load(out / "classifier.npz"))


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_dp_run_from_the_flags_reruns_from_its_config_yaml_to_the_same_bits(ray_session, tmp_path, capsys):
    """The flags, the --option spelling and the written config.yaml: one run, noise and all; the plain run differs."""
    run = ["--method", "fedncm", "--dataset", SPEC, *SMALL_RUN]
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in FLAGS.items()]
    rows, arrays = cli_run(capsys, tmp_path / "flags", *run, *flags)
    written = yaml.safe_load((tmp_path / "flags" / "config.yaml").read_text())
    assert {name: written[name] for name in FLAGS} == {"clip_norm": 2.5, "dp_delta": 1e-6, "dp_noise": 1.25,
                                                       "dp_placement": "distributed"}
    assert written["postprocessor"] == "dp" and written["dp_unit"] == "sample" and written["options"] == {"dp_accountant": "pld", "dp_threshold_share": 0.5, "dp_client_samples": None}
    again = cli_run(capsys, tmp_path / "again", "--config", str(tmp_path / "flags" / "config.yaml"))
    spelt = cli_run(capsys, tmp_path / "spelt", *run, "--postprocessor", "dp",
                    *[f"--option={name}={value}" for name, value in SPELT.items()])
    plain = cli_run(capsys, tmp_path / "plain", *run)
    assert [row["round"] for row in rows] == [3, 6]
    assert all(row["clip_norm"] == 2.5 and row["dp_delta"] == 1e-6 and row["dp_noise"] == 1.25 and 0 < row["dp_epsilon"]
               < float("inf") for row in rows)
    for other_rows, other_arrays in (again, spelt):
        assert other_rows == rows and other_arrays.keys() == arrays.keys()
        assert all(other_arrays[key].tobytes() == arrays[key].tobytes() for key in arrays)
    assert plain[1].keys() == arrays.keys() and not np.array_equal(plain[1]["W"], arrays["W"])


def test_a_dp_fedavg_run_samples_by_poisson_unless_told_or_poisson_does_not_apply():
    """DP-FedAvg's usual ε is Poisson sampling's: its default there; with in a plain training run and where Poisson
    does not apply (fine-tuning on images); what the run says, always."""
    dp = {"clip_norm": 1.0, "dp_delta": 1e-5, "dp_noise": 1.0}
    assert resolve({}, {"method": "fedavg", **dp}).sampling == "poisson"
    assert resolve({}, {"method": "scaffold", "postprocessor": "dp-fedavg",
                        "options": {name: str(value) for name, value in dp.items()}}).sampling == "poisson"
    assert resolve({}, {"method": "fedavg", "sampling": "with", **dp}).sampling == "with"
    assert resolve({}, {"method": "fedavg"}).sampling == "with"
    on_images = {"finetune": "ft", "dataset": "hsu:train.csv?images=x"}
    assert resolve({}, {"method": "fedavg", **on_images, **dp}).sampling == "with"
    assert resolve({}, {"method": "fedncm", **dp}).sampling == "without"


def rerun_of_the_record(capsys, tmp_path: Path, run: list[str], budget: float) -> float:
    """``run`` with ``--dp-epsilon budget``, then its config.yaml and ``--dp-noise σ`` (σ its record): the same rows
    and bits. Returns σ."""
    rows, arrays = cli_run(capsys, tmp_path / "budget", *run, f"--dp-epsilon={budget}")
    written = yaml.safe_load((tmp_path / "budget" / "config.yaml").read_text())
    noise = written["dp_noise"]
    assert written["dp_epsilon"] == budget and rows[-1]["dp_epsilon"] <= budget
    assert all(row["dp_noise"] == noise and row["clip_norm"] == 0.5 for row in rows)
    for again in (cli_run(capsys, tmp_path / "again", "--config", str(tmp_path / "budget" / "config.yaml")),
                  cli_run(capsys, tmp_path / "noise", *run, f"--dp-noise={noise!r}")):
        assert again[0] == rows and again[1].keys() == arrays.keys()
        assert all(again[1][key].tobytes() == arrays[key].tobytes() for key in arrays)
    return noise


def test_a_closed_forms_calibrated_noise_is_recorded_and_reruns_to_the_same_bits(ray_session, tmp_path, capsys):
    run = ["--method", "fed3r", "--dataset", SPEC, *SMALL_RUN, "--clip-norm=0.5", "--dp-delta=1e-5"]
    noise = rerun_of_the_record(capsys, tmp_path, run, 2.0)
    assert noise == calibrated(2.0, 1e-5, "pld")
    rows = pq.read_table(tmp_path / "budget" / "metrics.parquet").to_pylist()
    assert all(row["dp_accountant"] == "pld" and row["sampling"] == "without" for row in rows)


def test_dp_fedavgs_calibrated_noise_accountant_and_sampling_are_recorded_and_rerun_to_the_same_bits(
        ray_session, tmp_path, capsys):
    """No --sampling, no accountant: Poisson and PLD, both in config.yaml and every row, σ calibrated over the run's 6
    rounds of q = 8/K."""
    from fedray.data.registry import load_federation

    run = ["--method", "fedavg", "--dataset", SPEC, *SMALL_RUN, "--clip-norm=0.5", "--dp-delta=1e-5"]
    noise = rerun_of_the_record(capsys, tmp_path, run, 4.0)
    written = yaml.safe_load((tmp_path / "budget" / "config.yaml").read_text())
    assert written["sampling"] == "poisson" and written["options"]["dp_accountant"] == "pld"
    rows = pq.read_table(tmp_path / "budget" / "metrics.parquet").to_pylist()
    assert all(row["sampling"] == "poisson" and row["dp_accountant"] == "pld" for row in rows)
    population = load_federation(SPEC).num_clients
    assert noise == calibrated_over_rounds(4.0, 1e-5, "pld", "poisson", population, 8, 6)


def test_a_noise_that_spends_more_than_the_budget_given_with_it_is_refused():
    with pytest.raises(FedrayError, match=r"^--postprocessor dp: dp_noise=0.5 spends ε = .* over one release, more "
                                          r"than dp_epsilon=1: give one of them, or a larger σ$"):
        built = postprocessing(resolve({}, {"method": "fed3r", "clip_norm": 1.0, "dp_delta": 1e-5, "dp_epsilon": 1.0,
                                            "dp_noise": 0.5}))
        built.start((StageUploads("closed form", False, Sampling(10, 2), 5, 2, 2),))
