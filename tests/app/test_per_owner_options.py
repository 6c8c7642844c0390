"""An option of the same name declared by two of a run's classes: a plain ``--option x=...`` is refused in one line
naming both owners, and ``--option Owner.x=...`` gives it to one owner only, from every source of options."""

import pytest
import yaml

import fedray
import fedray.engine.run_config
from fedray.app.cli import main
from fedray.app.sweeps.spec import load_sweep
from fedray.app.sweeps.trials import trial_config
from fedray.engine.config import resolve
from fedray.engine.config_files import load_config_file
from fedray.engine.plan import postprocessing
from fedray.engine.settings import server_optimizer, training_algorithm
from tests.engine.test_run_start import no_ray_start

PLUGINS = '''
from dataclasses import dataclass
from typing import Annotated

import fedray


@dataclass(frozen=True)
class Smooth(fedray.FederatedAlgorithm):
    x: Annotated[float, "the algorithm's x"] = 1.0
    only_mine: int = 3


class Clip(fedray.Postprocessor):
    def __init__(self, x: Annotated[float, "the postprocessor's x"] = 2.0, y: str = "a") -> None:
        super().__init__()
        self.x, self.y = x, y


class Scaled(fedray.ServerOptimizer):
    default_lr = 1.0

    def __init__(self, server_lr: float | None = None, only_mine: int = 4) -> None:
        super().__init__(server_lr)
        self.only_mine = only_mine

    def step(self, params, delta):
        return {name: params[name] + change for name, change in delta.items()}
'''


@pytest.fixture
def specs(tmp_path):
    path = tmp_path / "owners.py"
    path.write_text(PLUGINS)
    return {name: f"{path}:{name}" for name in ("Smooth", "Clip", "Scaled")}


def run(specs, options=None, **values):
    """The resolved configuration of a fedavg-shaped run of the plugin algorithm with the plugin postprocessor."""
    return resolve({}, {"method": specs["Smooth"], "postprocessor": specs["Clip"], "options": options or {}, **values})


def test_a_plain_option_two_owners_declare_is_one_line_naming_both(specs):
    with pytest.raises(fedray.FedrayError) as error:
        run(specs, {"x": "3"})
    assert str(error.value) == ("--option x: Smooth (--method) and Clip (--postprocessor) declare an option x; give it "
                                "per owner: --option Smooth.x=... and --option Clip.x=...")


def test_per_owner_options_reach_their_owner_only(specs):
    config = run(specs, {"Smooth.x": "3", "Clip.x": 0.5, "y": "b"})
    assert config.options == {"Smooth.x": 3.0, "Clip.x": 0.5, "y": "b", "only_mine": 3}
    assert training_algorithm(config).x == 3.0
    (clip,) = postprocessing(config).postprocessors
    assert (clip.x, clip.y) == (0.5, "b")
    assert {key: value for key, value in config.metrics_columns().items() if key in config.options} == config.options


def test_an_option_two_owners_declare_is_kept_per_owner_at_its_defaults(specs):
    config = run(specs)
    assert config.options == {"Smooth.x": 1.0, "only_mine": 3, "Clip.x": 2.0, "y": "a"}
    assert (training_algorithm(config).x, postprocessing(config).postprocessors[0].x) == (1.0, 2.0)
    assert run(specs, config.options).options == config.options   # as config.yaml holds it, it runs again


def test_an_option_one_owner_declares_given_per_owner_is_its_plain_option(specs):
    config = run(specs, {"Smooth.only_mine": "7"})
    assert config.options["only_mine"] == 7 and "Smooth.only_mine" not in config.options
    with pytest.raises(fedray.FedrayError) as error:
        run(specs, {"Smooth.only_mine": 7, "only_mine": 8})
    assert str(error.value) == "--option only_mine: Smooth (--method)'s option only_mine is given twice: as " \
        "Smooth.only_mine and as only_mine"


def test_a_server_optimizers_option_of_the_same_name_is_per_owner_too(specs):
    config = run(specs, {"Smooth.only_mine": 5, "Scaled.only_mine": 6}, server_optimizer=specs["Scaled"])
    assert (training_algorithm(config).only_mine, server_optimizer(config).only_mine) == (5, 6)
    with pytest.raises(fedray.FedrayError, match=r"^--option only_mine: Smooth \(--method\) and Scaled "
                                                  r"\(--server-optimizer\) declare an option only_mine;"):
        run(specs, {"only_mine": 5}, server_optimizer=specs["Scaled"])


@pytest.mark.parametrize("options, message", [
    ({"Nobody.x": 1}, "--option Nobody.x: Nobody is none of this run's classes whose options --option sets: "
                      "Smooth (--method), Clip (--postprocessor)"),
    ({"Clip.only_mine": 1}, "--option Clip.only_mine: Clip (--postprocessor) has no option only_mine; its options: x, y"),
    ({"Clip.x": "wide"}, "--option: option x must be a number, got 'wide'"),
    ({"Smooth.client_lr": 1}, "--option client_lr: client_lr is a run option: use --client-lr"),
])
def test_a_bad_per_owner_option_is_one_line(specs, options, message):
    with pytest.raises(fedray.FedrayError) as error:
        run(specs, options)
    assert str(error.value) == message


def test_a_built_in_owner_is_named_by_its_method_name_or_class(specs):
    assert resolve({}, {"method": "fedprox", "options": {"fedprox.prox_mu": "0.1"}}) == \
        resolve({}, {"method": "fedprox", "prox_mu": 0.1}) == \
        resolve({}, {"method": "fedprox", "options": {"FedProx.prox_mu": 0.1}})
    assert resolve({}, {"method": "feddyn", "options": {"feddyn.alpha": "0.2"}}).options == {"alpha": 0.2}
    with pytest.raises(fedray.FedrayError) as error:
        resolve({}, {"method": "fedprox", "options": {"fedavg.prox_mu": 0.1}})
    assert str(error.value) == "--option fedavg.prox_mu: prox_mu is an option of the training algorithm fedprox, not of fedavg"
    with pytest.raises(fedray.FedrayError) as error:
        resolve({}, {"method": "fedprox", "options": {"fedprox.prox_mu": 0.1, "prox_mu": 0.2}})
    assert str(error.value) == "--option prox_mu is given twice: as fedprox.prox_mu and as prox_mu"


@pytest.fixture
def engine(monkeypatch):
    """The engine's run as a sentinel that returns the configuration every check passed with, as an exception."""
    def reached(config, **_):
        raise Reached(config)

    monkeypatch.setattr(fedray.engine.run_config, "run", reached)

    no_ray_start(monkeypatch)  # fedray run begins no Ray before it reaches the engine

class Reached(Exception):
    def __init__(self, config):
        self.config = config


def test_per_owner_options_from_the_command_line_a_config_file_python_and_a_sweep(specs, engine, tmp_path, capsys):
    expected = run(specs, {"Smooth.x": 3.0, "Clip.x": 0.5}).options
    with pytest.raises(Reached) as line:
        main(["run", "--method", specs["Smooth"], "--postprocessor", specs["Clip"], "--option", "Smooth.x=3",
              "--option", "Clip.x=0.5", "--out", str(tmp_path / "cli")])
    assert line.value.config.options == expected
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"method": specs["Smooth"], "postprocessor": specs["Clip"],
                                    "options": {"Smooth.x": 3, "Clip.x": 0.5}}))
    assert resolve(load_config_file(path), {}).options == expected
    with pytest.raises(Reached) as python:
        fedray.run(method=specs["Smooth"], postprocessor=specs["Clip"], options={"Smooth.x": 3, "Clip.x": 0.5},
                   out=tmp_path / "python")
    assert python.value.config.options == expected
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "owners", "base": {"method": specs["Smooth"], "postprocessor": specs["Clip"],
                                                               "options.Clip.x": 0.5},
                                    "grid": {"options.Smooth.x": [3.0, 4.0]}}))
    sweep = load_sweep(path)
    trial = trial_config({**sweep.base, "options.Smooth.x": 3.0}, str(tmp_path / "trial"))
    assert trial.options == expected
    path.write_text(yaml.safe_dump({"name": "owners", "base": {"method": specs["Smooth"], "postprocessor": specs["Clip"],
                                                               "options": {"Clip.x": 0.5}}, "grid": {"seed": [0]}}))
    assert load_sweep(path).base["options.Clip.x"] == 0.5


def test_two_classes_of_one_name_declaring_one_option_is_one_line(specs, tmp_path):
    other = tmp_path / "elsewhere.py"
    other.write_text(PLUGINS)
    with pytest.raises(fedray.FedrayError) as error:
        resolve({}, {"method": "fedavg", "postprocessor": f"{specs['Clip']},{other}:Clip"})
    assert str(error.value) == "--option: two of this run's classes named Clip declare an option x; give them " \
        "different class names"
    # one class given twice is one owner
    assert run(specs, postprocessor=f"{specs['Clip']},{specs['Clip']}").options == run(specs).options
