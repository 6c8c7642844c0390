"""``--calibrate METHOD``: a closed form after training, on the features at the trained parameters."""

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from fedray.app.cli import main
from fedray.core.errors import FedrayError
from fedray.data.registry import load_federation
from fedray.engine.config import RunConfig
from fedray.engine.run_config import run

SMALL = "synthetic:inat-user-120k?dim=24&scale=0.04&classes=60"
COMMON = {"num_shards": 2, "cpus_per_shard": 0.5, "quiet": True}


def ridge_classifier(spec: str, lam: float) -> np.ndarray:
    """Fed3R written out: W = (XᵀX + λI)⁻¹ XᵀY over every training sample in float64, each column divided by its norm."""
    federation = load_federation(spec)
    sample_ids, labels, _ = federation.train_arrays(0, federation.num_clients)
    x = federation.source.features("train", sample_ids).double().numpy()
    y = np.eye(federation.num_classes)[labels]
    w = np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]), x.T @ y)
    return w / np.linalg.norm(w, axis=0)


def test_calibrating_a_trained_head_with_fed3r_gives_the_ridge_classifier_of_every_client(ray_session, tmp_path):
    config = RunConfig(method="fedavg", dataset=SMALL, out=str(tmp_path / "calibrated"), rounds=4, eval_every=2,
                       calibrate="fed3r", **COMMON)
    completed = run(config)
    rows = completed.rows
    assert [row["stage"] for row in rows] == ["train", "train", "train", "calibrated"]
    assert [row["round"] for row in rows] == [0, 2, 4, 5]
    assert all(row["calibrate"] == "fed3r" for row in rows)
    np.testing.assert_allclose(completed.arrays["W"], ridge_classifier(SMALL, config.lam), rtol=1e-9, atol=1e-12)
    assert "bias" not in completed.arrays
    clients = load_federation(SMALL).num_clients
    assert np.array_equal(completed.rounds[-1], np.arange(clients)), "every client uploads once"
    assert rows[-1]["clients_seen"] == clients
    fed3r = run(RunConfig(method="fed3r", dataset=SMALL, out=str(tmp_path / "fed3r"), **COMMON)).rows[-1]
    assert rows[-1]["accuracy"] == pytest.approx(fed3r["accuracy"], abs=1 / 2000)  # the same classifier, summed in another order
    assert rows[-1]["bytes_up"] == rows[-2]["bytes_up"] + fed3r["bytes_up"], "the calibration's uploads are counted"
    saved = np.load(Path(config.out) / "classifier.npz")
    assert np.array_equal(saved["W"], completed.arrays["W"])
    assert pq.read_table(Path(config.out) / "metrics.parquet").column("stage").to_pylist()[-1] == "calibrated"


@pytest.mark.parametrize("flags, message", [
    (["--method", "fedavg", "--head", "sphere"], "--calibrate with --head sphere: SphereFed calibrates with its own FFC"),
    (["--method", "fed3r"], "--calibrate"),
])
def test_calibrate_is_refused_where_it_does_not_apply(tmp_path, capsys, flags, message):
    rc = main(["run", "--dataset", SMALL, "--out", str(tmp_path / "x"), "--calibrate", "fed3r", *flags])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_calibrate_takes_closed_form_methods_only():
    with pytest.raises(FedrayError, match="unknown closed-form method 'fedavg'"):
        RunConfig(method="fedavg", calibrate="fedavg").validate()
