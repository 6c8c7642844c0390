"""The older ``fedray.ClientAlgorithm`` interface was removed (a client's own loss or gradient correction is a
``fedray.FederatedAlgorithm``): each way of naming one is refused in one line saying what replaced it, before any work,
while an earlier run's config.yaml, which holds ``client_algorithm: null``, still loads and runs."""

from pathlib import Path

import pytest
import yaml

import fedray
import fedray.engine.run_config
from fedray.app.cli import main
from fedray.app.sweeps.spec import load_sweep
from fedray.engine.config import REMOVED, resolve
from fedray.engine.config_files import load_config_file
from tests.engine.test_run_start import no_ray_start

REPO = Path(__file__).resolve().parents[2]
PROXIMAL = f"{REPO / 'examples' / 'proximal_client.py'}:Proximal"
REPLACED = ("was removed: write your client's loss or gradient correction as a fedray.FederatedAlgorithm subclass and "
            "give it as --method FILE.py:Class (see examples/proximal_client.py)")


class EngineReached(Exception):
    """Raised in place of the engine's run: every check before it passed."""

    def __init__(self, config):
        self.config = config


@pytest.fixture
def engine(monkeypatch):
    """``fedray.engine.run_config.run`` as a sentinel that raises :class:`EngineReached` with its configuration."""
    def reached(config, **_):
        raise EngineReached(config)

    monkeypatch.setattr(fedray.engine.run_config, "run", reached)

    no_ray_start(monkeypatch)  # fedray run begins no Ray before it reaches the engine

def test_the_client_algorithm_is_the_one_removed_option():
    assert set(REMOVED) == {"client_algorithm"}


def test_client_algorithm_on_the_command_line_is_one_line_saying_what_replaced_it(capsys, tmp_path):
    rc = main(["run", "--method", "fedavg", "--client-algorithm", PROXIMAL, "--out", str(tmp_path / "out")])
    assert (rc, capsys.readouterr().err) == (2, f"fedray: error: --client-algorithm {REPLACED}\n")
    assert not (tmp_path / "out").exists()


def test_client_algorithm_in_a_config_file_is_one_line_and_null_is_dropped(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"method": "fedavg", "client_algorithm": PROXIMAL}))
    with pytest.raises(fedray.FedrayError) as error:
        load_config_file(path)
    assert str(error.value) == f"{path}: client_algorithm {REPLACED}"
    path.write_text(yaml.safe_dump({"method": "fedavg", "client_algorithm": None}))
    assert load_config_file(path) == {"method": "fedavg"}


def test_client_algorithm_in_fedray_run_is_one_line_and_none_is_dropped(engine, tmp_path):
    for value in (PROXIMAL, fedray.FederatedAlgorithm):
        with pytest.raises(fedray.FedrayError) as error:
            fedray.run(method="fedavg", client_algorithm=value, out=tmp_path / "out")
        assert str(error.value) == f"fedray.run: client_algorithm {REPLACED}"
    with pytest.raises(EngineReached) as reached:
        fedray.run(method="fedavg", client_algorithm=None, out=tmp_path / "out")
    assert not hasattr(reached.value.config, "client_algorithm")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("section, value", [("base", PROXIMAL), ("grid", [PROXIMAL])])
def test_client_algorithm_in_a_sweep_is_one_line(tmp_path, section, value):
    path = tmp_path / "sweep.yaml"
    sections = {"base": {"method": "fedavg"}, "grid": {"seed": [0, 1]}}
    sections[section] = {**sections[section], "client_algorithm": value}
    path.write_text(yaml.safe_dump({"name": "old", **sections}))
    with pytest.raises(fedray.FedrayError) as error:
        load_sweep(path)
    assert str(error.value) == f"{path}: {section}: client_algorithm {REPLACED}"


def test_a_sweeps_null_client_algorithm_is_dropped(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "old", "base": {"method": "fedavg", "client_algorithm": None},
                                    "grid": {"seed": [0, 1]}}))
    assert load_sweep(path).base == {"method": "fedavg"}


def test_an_earlier_runs_config_yaml_with_a_null_client_algorithm_runs(engine, capsys, tmp_path):
    """Every config.yaml a run wrote holds every option, the client algorithm as null when none was given."""
    written = resolve({}, {"method": "fedprox", "rounds": 3, "out": str(tmp_path / "old")}).to_dict()
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**written, "client_algorithm": None}))
    with pytest.raises(EngineReached) as reached:
        main(["run", "--config", str(path), "--out", str(tmp_path / "new")])
    assert reached.value.config.to_dict() == {**written, "out": str(tmp_path / "new")}
