"""``fedray sweep`` as a user runs it: what a failed trial prints, what a finished trial leaves in its folder, and a
sweep stopped by Ctrl-C and resumed.

Tune printed an ERROR log with the whole traceback per failed trial even with
``--quiet`` (55 lines for one failed trial, 108 for two), its configuration box
and results folders on stdout, and on Ctrl-C a hint to resume with
``Tuner.restore(...)`` where fedray's own line says ``--resume``. A trial's
run wrote to Tune's staging copy of its folder, which Tune copied into the
sweep's folder now and then: a copy made while a checkpoint was there kept
that ``checkpoint.pt`` beside the finished trial's results.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import polars as pl
import yaml

from fedray.app.cli import main
from fedray.core.results import METRICS
from fedray.app.sweeps.tuning import RESULTS
from tests.app.test_cli import fedray_subprocess
from tests.e2e.test_interrupts import REPO, last_line, process_tree, survivors, wait_until

TINY = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"
TRAINING = {"method": "fedavg", "clients_per_round": 5, "checkpoint_every": 2, "eval_every": 3, "dataset": TINY}
RUN_FILES = {"metrics.parquet", "classifier.npz", "config.yaml"}


def sweep_file(tmp_path: Path, name: str, base: dict, grid: dict) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "base": base, "grid": grid, "cpus_per_shard": 0.5, "driver_cpus": 0.5}))
    return path


def trial_folders(sweep: Path) -> list[Path]:
    return sorted(path for path in sweep.iterdir() if path.is_dir() and path.name.startswith("run_trial_"))


def assert_finished_trial(folder: Path) -> None:
    """Its run's files, no checkpoint, and its config.yaml names that folder as the run's --out."""
    names = {path.name for path in folder.iterdir()}
    assert RUN_FILES <= names and not {name for name in names if name.startswith("checkpoint")}, sorted(names)
    assert yaml.safe_load((folder / "config.yaml").read_text())["out"] == str(folder)


def test_failed_trials_are_one_line_each_and_a_finished_trial_leaves_no_checkpoint(tmp_path):
    missing = [tmp_path / "missing-1.parquet", tmp_path / "missing-2.parquet"]
    base = {key: value for key, value in TRAINING.items() if key != "dataset"}
    path = sweep_file(tmp_path, "mixed", {**base, "rounds": 6}, {"dataset": [TINY, *(f"parquet:{m}" for m in missing)]})
    rc, stdout, stderr, _ = fedray_subprocess(["sweep", "--config", path, "--out", tmp_path / "out", "--quiet"],
                                              timeout=600)

    folder = tmp_path / "out" / "mixed"
    assert rc == 2 and stdout == "", stdout
    assert stderr.splitlines() == [
        f"fedray: trial dataset=parquet:{missing[0]} failed: {missing[0]}: no such file",
        f"fedray: trial dataset=parquet:{missing[1]} failed: {missing[1]}: no such file",
        f"fedray: error: 2 of 3 trials failed (first: {missing[0]}: no such file); finished trials are in "
        f"{folder / RESULTS}; fix and rerun with --resume",
    ], stderr
    finished = [trial for trial in trial_folders(folder) if (trial / METRICS).is_file()]
    assert len(finished) == 1
    assert_finished_trial(finished[0])
    assert pl.read_parquet(folder / RESULTS)["round"].max() == 6


def test_a_sweep_stopped_by_ctrl_c_says_so_once_and_resumes_to_the_uninterrupted_results(ray_session, tmp_path):
    """The trial's run is long enough (1,000 rounds, a checkpoint every 20) for Ctrl-C to come after its first
    checkpoint and before its end; the uninterrupted run it is compared with runs in this process."""
    training = {**TRAINING, "rounds": 1000, "checkpoint_every": 20, "eval_every": 250}
    path = sweep_file(tmp_path, "resumed", training, {"seed": [0]})
    out, log = tmp_path / "out", tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        driver = subprocess.Popen([sys.executable, "-m", "fedray", "sweep", "--config", str(path), "--out", str(out),
                                   "--quiet"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr,
                                  start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_until(lambda: any(out.glob("resumed/run_trial_*/checkpoint.pt")), driver, log)
        processes = process_tree(driver.pid)
        os.killpg(driver.pid, signal.SIGINT)
        assert driver.wait(timeout=60) == 130
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    folder = out / "resumed"
    assert log.read_text().splitlines() == [
        f"fedray: stopped by SIGINT: the sweep's state is kept in {folder}; continue with --resume"], log.read_text()
    assert survivors(processes) == {}
    assert not (folder / RESULTS).exists() and any(folder.glob("experiment_state-*.json")), "Tune's state, no table"
    (trial,) = trial_folders(folder)
    assert (trial / "checkpoint.pt").is_file(), "the interrupted trial's checkpoint, to continue from"

    rc, stdout, stderr, _ = fedray_subprocess(["sweep", "--config", path, "--out", out, "--quiet", "--resume"],
                                              timeout=600)
    assert rc == 0 and stderr == "", stderr
    assert stdout == f"sweep resumed: 1 trials, 5 evaluation rows → {folder / RESULTS}\n"
    assert_finished_trial(trial)
    uninterrupted = tmp_path / "uninterrupted"
    assert main(["run", "--method", "fedavg", "--dataset", TINY, "--clients-per-round", "5", "--rounds", "1000",
                 "--eval-every", "250", "--checkpoint-every", "20", "--num-shards", "1", "--cpus-per-shard", "0.5",
                 "--quiet", "--out", str(uninterrupted)]) == 0
    columns = ["round", "clients_seen", "samples_seen", "accuracy", "bytes_up", "bytes_down", "train_loss"]
    assert pl.read_parquet(trial / METRICS).select(columns).equals(pl.read_parquet(uninterrupted / METRICS).select(columns))
