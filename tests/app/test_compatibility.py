"""Files written by earlier fedray still work: a config.yaml of commit 45680fe (before client momentum, lr schedules,
the papers' accounting columns) loads and reproduces that version's results.

The stored results were written on one machine. fedray's promise is bitwise on one machine and software stack (the
seeded-run tests check that); across machines the float32 kernels of the heads' training differ in their last bits
(an AVX-512 Xeon's GEMMs moved 20 of these 48 weights by 2.2e-7 relative), so the weights are compared to 1e-6 of their
scale, the rows exactly (a last-bit change of a weight moves no prediction here)."""

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from fedray.app.cli import main

OLD_CONFIG = Path(__file__).parent / "data" / "config_45680fe.yaml"


def test_a_config_yaml_of_an_earlier_version_reproduces_its_run(ray_session, tmp_path):
    assert main(["run", "--config", str(OLD_CONFIG), "--out", str(tmp_path)]) == 0
    metrics = pl.read_parquet(tmp_path / "metrics.parquet")
    # What commit 45680fe's `fedray run --config` of this file wrote to metrics.parquet and classifier.npz, with the torch of its day.
    assert metrics.select("round", "accuracy", "bytes_up").rows() == [(0, 0.23032629558541268, 0.0), (3, 0.06525911708253358, 3240.0)]
    # The training loss is a sum of float32 losses whose last bits follow torch's reduction kernels and the order of
    # the sum (torch 2.15.0 gave 2.721785712886501; summed per leaf of the fixed tree since, 2.7217859770800614): the
    # same to float32 precision (same torch, same bits: the seeded-run tests check that).
    assert metrics["train_loss"][0] is None
    assert metrics["train_loss"][1] == pytest.approx(2.7217856999990104, rel=1e-6)
    head = np.load(tmp_path / "classifier.npz")
    # on the machine that stored them, bitwise: 0x1.f4243a0000000p+3 and 0x1.b9751a0000000p+0
    assert float(np.abs(head["W"]).sum()) == pytest.approx(float.fromhex("0x1.f4243a0000000p+3"), rel=1e-6)
    assert float(np.abs(head["bias"]).sum()) == pytest.approx(float.fromhex("0x1.b9751a0000000p+0"), rel=1e-6)


OLD_CHECKPOINT = Path(__file__).parent / "data" / "checkpoint_85d3237.pt"
OLD_HEAD = Path(__file__).parent / "data" / "classifier_85d3237.npz"


def test_a_checkpoint_of_an_earlier_version_resumes_to_that_versions_head(ray_session, tmp_path):
    """Commit 85d3237 (before the training algorithms kept client states with the clients) wrote this checkpoint after
    round 4 of `fedray run` with the options below, and classifier.npz after round 6: resumed now, the same head."""
    import shutil

    shutil.copy(OLD_CHECKPOINT, tmp_path / "checkpoint.pt")
    arguments = ["run", "--method", "fedavg", "--dataset", "synthetic:inat-geo-100?dim=8&scale=0.2&classes=6",
                 "--client-lr", "0.05", "--rounds", "6", "--eval-every", "2", "--checkpoint-every", "4", "--num-shards",
                 "2", "--cpus-per-shard", "1", "--seed", "5", "--quiet", "--out", str(tmp_path), "--resume"]
    assert main(arguments) == 0
    head, old = np.load(tmp_path / "classifier.npz"), np.load(OLD_HEAD)
    assert sorted(head.files) == sorted(old.files) == ["W", "bias"]
    assert all(np.abs(head[name] - old[name]).max() <= 1e-6 * np.abs(old[name]).max() for name in old.files)
    metrics = pl.read_parquet(tmp_path / "metrics.parquet")
    # what commit 85d3237's uninterrupted run wrote to metrics.parquet
    assert metrics.select("round", "accuracy", "bytes_up").rows() == [
        (0, 0.14281245111841076, 0.0), (2, 0.22931331143438136, 4320.0), (4, 0.30204911622086655, 8640.0),
        (6, 0.30157985296417955, 12960.0)]
    assert not (tmp_path / "checkpoint.pt").exists()
