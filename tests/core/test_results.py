"""A run's files replace the previous run's as a whole: a folder with metrics.parquet never mixes two runs, and a run
that cannot finish writing (a full disk) leaves the previous run byte for byte, says so in one line, and leaves no
temporaries."""

import os
import re

import numpy as np
import pytest
import torch

import fedray.core.results as results
from fedray.core.errors import FedrayError
from fedray.core.results import write_atomically, write_run
from tests.full_disk import disk_full, fill, hashes, small_disk  # noqa: F401 (a fixture)

RUN_FILES = ["classifier.npz", "config.yaml", "metrics.parquet"]
WRITERS = {"classifier.npz": "_save_npz", "model.pt": "_save_model", "config.yaml": "_save_text",
           "metrics.parquet": "_save_table"}


def run_files(seed: int, classifier_shape: tuple[int, int], model: bool) -> tuple:
    """``write_run``'s arguments for a run of ``seed``; the classifier W is float64 zeros of ``classifier_shape``."""
    rows = [{"round": 1, "accuracy": 0.25 + seed, "seed": seed}]
    config = {"method": "fed3r", "seed": seed}
    arrays = {"W": np.full(classifier_shape, float(seed)), "bias": np.zeros(classifier_shape[1])}
    return rows, config, arrays, {"head.weight": torch.full((10, 10), float(seed))} if model else None


@pytest.fixture(params=[(False, True), (True, False)], ids=["model-added", "model-dropped"])
def two_runs(request, tmp_path):
    """A folder holding a complete previous run, and the arguments of a new one whose classifier W is 2,000,000 bytes
    (500 × 500 float64); one of the two has a fine-tuned model.pt."""
    previous_model, new_model = request.param
    out = tmp_path / "run"
    write_run(out, *run_files(0, (4, 3), previous_model))
    return out, run_files(1, (500, 500), new_model)


def test_a_new_run_replaces_every_file_of_the_previous_one(two_runs):
    out, new = two_runs
    write_run(out, *new)
    assert sorted(os.listdir(out)) == sorted(RUN_FILES + (["model.pt"] if new[3] else []))
    with np.load(out / "classifier.npz") as arrays:
        assert arrays["W"].shape == (500, 500) and (arrays["W"] == 1.0).all()
    assert (out / "config.yaml").read_text() == "method: fed3r\nseed: 1\n"


def test_a_folder_with_metrics_never_holds_files_of_two_runs(monkeypatch, two_runs):
    """After every rename of the swap, a folder holding metrics.parquet holds the previous run's files or the new ones."""
    out, new = two_runs
    previous = hashes(out)
    seen = []
    replace = os.replace

    def observed(source, target):
        replace(source, target)
        seen.append({name: digest for name, digest in hashes(out).items() if not name.endswith(".tmp")})

    monkeypatch.setattr(os, "replace", observed)
    write_run(out, *new)
    final = hashes(out)
    assert seen[-1] == final != previous
    assert all(state in (previous, final) for state in seen if "metrics.parquet" in state), seen


def expect_disk_full(out, new, written=None):
    with pytest.raises(FedrayError) as error:
        write_run(out, *new)
    assert re.fullmatch(rf"disk full: writing {re.escape(str(written or out))} needed 2\.0 MB, [0-9.]+ [kM]B free",
                        str(error.value)), error.value


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_file_that_cannot_be_written_leaves_the_previous_run(monkeypatch, two_runs, name):
    out, new = two_runs
    if name == "model.pt" and new[3] is None:
        pytest.skip("the new run has no model.pt")
    previous = hashes(out)

    def half_written(path, *args):
        path.write_bytes(b"x" * 1000)
        raise disk_full()

    monkeypatch.setattr(results, WRITERS[name], half_written)
    expect_disk_full(out, new)
    assert hashes(out) == previous


@pytest.mark.parametrize("failing", range(1, 8))
def test_a_rename_that_fails_leaves_the_previous_run(monkeypatch, two_runs, failing):
    """The swap renames seven times (the previous run's four or three files aside, the new run's three or four in):
    whichever fails, every earlier one is undone."""
    out, new = two_runs
    previous = hashes(out)
    calls = []
    replace = os.replace

    def failing_once(source, target):
        calls.append(target)
        if len(calls) == failing:
            raise disk_full()
        replace(source, target)

    monkeypatch.setattr(os, "replace", failing_once)
    expect_disk_full(out, new)
    assert hashes(out) == previous


def test_a_run_onto_a_full_disk_leaves_the_previous_run(small_disk):
    out = small_disk / "run"
    write_run(out, *run_files(0, (4, 3), model=True))
    fill(small_disk)
    previous = hashes(small_disk)
    with pytest.raises(FedrayError, match=rf"^disk full: writing {re.escape(str(out))} needed 0\.2 MB, 0 kB free$"):
        write_run(out, *run_files(1, (200, 100), model=True))  # W: 160,000 bytes
    assert hashes(small_disk) == previous


def test_a_run_whose_first_files_fit_leaves_the_previous_run(small_disk):
    """The new classifier (0.8 MB) fits beside the previous run; its model (0.4 MB) does not: both temporaries go."""
    out = small_disk / "run"
    write_run(out, *run_files(0, (4, 3), model=False))
    previous = hashes(small_disk)
    rows, config, arrays, _ = run_files(1, (1000, 100), model=False)
    with pytest.raises(FedrayError, match=rf"^disk full: writing {re.escape(str(out))} needed 1\.2 MB, 1\.0 MB free$"):
        write_run(out, rows, config, arrays, {"weight": torch.zeros(100_000)})
    assert hashes(small_disk) == previous


def test_a_single_file_onto_a_full_disk_is_not_written(small_disk):
    path = small_disk / "summary.csv"
    path.write_text("previous\n")
    fill(small_disk)
    with pytest.raises(FedrayError, match=rf"^disk full: writing {re.escape(str(path))} needed more than 0 kB, 0 kB free$"):
        write_atomically(path, lambda p: p.write_text("x" * 10_000))
    assert path.read_text() == "previous\n" and sorted(os.listdir(small_disk)) == ["filler", "summary.csv"]


def test_a_full_disk_counts_what_was_needed_in_the_filesystems_blocks(small_disk):
    """Three small files (classifier, config, metrics) with two 4 kB blocks free: each takes a whole block, so the need
    is 12 kB, never below what is free."""
    out = small_disk / "run"
    fill(small_disk)
    with open(small_disk / "filler", "r+b") as filler:
        filler.truncate(os.path.getsize(small_disk / "filler") - 8192)
    assert os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize == 8192
    with pytest.raises(FedrayError, match=rf"^disk full: writing {re.escape(str(out))} needed 12\.3 kB, 8\.19 kB free$"):
        write_run(out, *run_files(0, (4, 3), model=False))
    assert sorted(os.listdir(out)) == []
