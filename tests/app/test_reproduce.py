"""``fedray reproduce``: a finished run rerun from its config.yaml, bitwise equal or the difference named; refusals."""

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import fedray
import fedray.engine.run_config
from fedray.app.cli import main
from fedray.app.reproduce import Difference, compare_runs, relative_difference
from fedray.core.results import write_run
from tests.engine.test_run_start import no_ray_start

SPEC = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(ray_session, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reproduce") / "run"
    fedray.run(method="fed3r", dataset=SPEC, out=out, num_shards=2, cpus_per_shard=0.5, clients_per_round=40,
               quiet=True)
    return out


def reproduced(capsys, *argv: str) -> tuple[int, str]:
    code = main(["reproduce", *argv])
    out, err = capsys.readouterr()
    return code, out + err


def test_a_rerun_of_a_finished_run_is_bitwise_equal(finished_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = files_under(out)
    code, said = reproduced(capsys, str(out))
    rerun = tmp_path / "run-reproduced"
    assert (code, said) == (0, "bitwise equal: classifier and metrics (wall-clock columns excluded: wall_s); "
                               f"environment fields that differ: none; rerun in {rerun}\n")
    assert files_under(out) == before, "the run folder is never written"
    assert json.loads((rerun / "run.json").read_text())["command"] == f"fedray reproduce {out}"


def test_a_hand_edited_configuration_is_told_with_the_difference_and_the_field(finished_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["lam"] == 0.01
    (out / "config.yaml").write_text(yaml.safe_dump({**config, "lam": 0.1}, sort_keys=False))
    made = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**made, "torch": "1.0.0"}))
    code, said = reproduced(capsys, str(out), "--out", str(tmp_path / "again"))
    assert code == 1, said
    # the metrics' lam column: |0.01 - 0.1| / 0.1 = 0.9; the classifier's W moves with λ
    environment = f"torch (1.0.0 → {torch.__version__}); rerun in {tmp_path / 'again'}\n"
    assert re.fullmatch(r"different: classifier up to \S+ relative \(W\), metrics up to 0\.9 relative \(lam\) "
                        r"\(wall-clock columns excluded: wall_s\); environment fields that differ: "
                        + re.escape(environment), said), said


@pytest.fixture
def no_rerun(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("the rerun started: the input should have been refused before it")

    monkeypatch.setattr(fedray.engine.run_config, "run", refused)

    no_ray_start(monkeypatch)  # fedray run begins no Ray before it reaches the engine

@pytest.mark.parametrize("present, message", [
    (None, "{out}: no such run folder"),
    ([], "{out}: not a run folder (no config.yaml)"),
    (["checkpoint.pt"], "{out}: an unfinished run (checkpoint.pt, no config.yaml); finish it with --resume first"),
    (["config.yaml", "classifier.npz"], "{out}: an unfinished run (no metrics.parquet)"),
    (["config.yaml", "metrics.parquet"], "{out}: an unfinished run (no classifier.npz)"),
], ids=["missing", "empty", "checkpoint-only", "no-metrics", "no-classifier"])
def test_a_folder_without_a_finished_run_is_refused_in_one_line(no_rerun, tmp_path, capsys, present, message):
    out = tmp_path / "run"
    if present is not None:
        out.mkdir()
        for name in present:
            (out / name).write_text("x\n")
    code, said = reproduced(capsys, str(out))
    assert (code, said) == (2, f"fedray: error: {message.format(out=out)}\n")
    assert sorted(os.listdir(tmp_path)) == ([] if present is None else ["run"]), "nothing written"


@pytest.mark.parametrize("new", ["./run", "run/rerun"], ids=["itself", "inside"])
def test_the_rerun_never_writes_the_run_folder(no_rerun, tmp_path, capsys, new):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("config.yaml", "metrics.parquet", "classifier.npz"):
        (out / name).write_text("x\n")
    code, said = reproduced(capsys, str(out), "--out", str(tmp_path / new))
    assert (code, said) == (2, f"fedray: error: --out {tmp_path / new}: is the run folder being reproduced, or inside "
                               "it; name another folder\n")
    assert sorted(os.listdir(out)) == ["classifier.npz", "config.yaml", "metrics.parquet"]


def test_the_default_rerun_folder_is_a_fresh_one_beside_the_run(finished_run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    (tmp_path / "run-reproduced").mkdir()
    written = []
    monkeypatch.setattr(fedray.engine.run_config, "run", lambda config, **_: written.append(config.out))
    no_ray_start(monkeypatch)  # fedray run begins no Ray before it reaches the engine
    monkeypatch.setattr(fedray.app.reproduce, "compare_runs", lambda recorded, rerun: None)
    fedray.app.reproduce.reproduce(out)
    assert written == [str(tmp_path / "run-reproduced-2")]


def write_folder(folder: Path, weight: list, accuracy: float, stage: str, wall_s: float, record: dict | None) -> Path:
    row = {"round": 1, "accuracy": accuracy, "lam": 0.01, "stage": stage, "wall_s": wall_s, "train_loss": None}
    write_run(folder, [row], {"method": "fed3r"}, {"W": np.array(weight)}, record=record)
    return folder


def test_runs_differing_only_in_wall_clock_time_are_equal(tmp_path):
    made = {"torch": "2.5.1", "threads": 1, "started": "a"}
    first = write_folder(tmp_path / "a", [[1.0, 2.0], [3.0, 4.0]], 0.5, "closed_form", 1.0, made)
    second = write_folder(tmp_path / "b", [[1.0, 2.0], [3.0, 4.0]], 0.5, "closed_form", 7.0, {**made, "started": "b"})
    comparison = compare_runs(first, second)
    assert comparison.equal and comparison.environment == []


def test_the_largest_relative_difference_and_the_differing_names_are_told(tmp_path):
    first = write_folder(tmp_path / "a", [[1.0, 2.0], [3.0, 4.0]], 0.5, "closed_form", 1.0, None)
    second = write_folder(tmp_path / "b", [[1.0, 2.0], [3.0, 5.0]], 0.25, "train", 1.0, {"torch": "2.5.1"})
    comparison = compare_runs(first, second)
    assert comparison.classifier == Difference(("W",), 0.2)  # |4 - 5| / 5
    assert comparison.metrics == Difference(("accuracy", "stage"), 0.5)  # |0.5 - 0.25| / 0.5; a text column after
    assert comparison.environment is None and "environment not compared (no run.json in the run folder)" in \
        comparison.line()


def test_relative_differences():
    assert relative_difference(np.array([0.0, 0.0]), np.array([0.0, -0.0])) == 0.0
    assert relative_difference(np.array([2.0, np.nan, np.inf]), np.array([1.0, np.nan, np.inf])) == 0.5
    assert relative_difference(np.array([1.0, np.nan]), np.array([1.0, 1.0])) == float("inf")
    assert relative_difference(np.array([1.0, np.inf]), np.array([1.0, -np.inf])) == float("inf")
    assert relative_difference(np.array([1.0]), np.array([1.0, 1.0])) == float("inf")
    assert relative_difference(np.array([1, 3], dtype=np.int64), np.array([1, 4], dtype=np.int64)) == 0.25
