"""How a run names a plugin class it was given as a class: a spec that ``fedray run --config`` imports again."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import fedray
from fedray.core.plugins import spec_of

REPO = Path(__file__).resolve().parents[2]
SPEC = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"


def test_a_class_of_a_module_in_the_working_directory_or_installed_is_named_by_its_module(monkeypatch):
    monkeypatch.chdir(REPO)
    from fedray.methods.training.server import ServerSGD
    from tests.app.test_api import Doubling  # tests/ is a package in the working directory
    assert spec_of(fedray.Postprocessor) == "fedray.methods.postprocessor:Postprocessor"
    assert spec_of(ServerSGD) == "fedray.methods.training.server:ServerSGD"
    assert spec_of(np.random.Generator) == "numpy.random._generator:Generator"
    assert spec_of(Doubling) == "tests.app.test_api:Doubling"


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_python_runs_plugin_from_a_module_elsewhere_is_recorded_by_its_file_and_reruns(ray_session, tmp_path,
                                                                                          monkeypatch):
    """``ccvr.py`` beside the script that imported it, the run started in another folder: config.yaml names the
    file, and ``fedray run --config`` (a fresh process in that folder) runs it again to the same classifier."""
    library, work = tmp_path / "library", tmp_path / "work"
    library.mkdir(), work.mkdir()
    (library / "ccvr_plugin.py").write_text((REPO / "examples" / "nearest_class_mean.py").read_text())
    monkeypatch.syspath_prepend(str(library))
    monkeypatch.chdir(work)
    try:
        plugin = importlib.import_module("ccvr_plugin").NearestClassMean
        assert spec_of(plugin) == f"{library / 'ccvr_plugin.py'}:NearestClassMean"
        first = fedray.run(method=plugin, dataset=SPEC, out="first", num_shards=2, cpus_per_shard=0.5, quiet=True)
    finally:
        sys.modules.pop("ccvr_plugin", None)
    recorded = yaml.safe_load((work / "first" / "config.yaml").read_text())
    assert recorded["method"] == f"{library / 'ccvr_plugin.py'}:NearestClassMean"
    done = subprocess.run([sys.executable, "-m", "fedray", "run", "--config", "first/config.yaml", "--out", "again"],
                          cwd=work, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    with np.load(work / "again" / "classifier.npz") as again:
        assert np.array_equal(again["W"], first.classifier.weight.numpy())
