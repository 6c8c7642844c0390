"""SphereFed on features: training moves only the projection, FFC calibration is the exact least squares and helps."""

import numpy as np
import pytest
import torch

from fedray.config import RunConfig
from fedray.data.registry import load_federation
from fedray.errors import FedrayError
from fedray.run import run

SKEWED = "synthetic:inat-user-120k?dim=24&scale=0.04&classes=60&seed=3&split=dirichlet&alpha=0.1&clients=50"


def test_spherefed_trains_the_projection_then_calibrates_to_the_least_squares_solution(ray_session, tmp_path):
    out = tmp_path / "sphere"
    config = RunConfig(method="fedavg", head="sphere", sphere_dim=16, client_lr=0.5, dataset=SKEWED, out=str(out),
                       rounds=60, eval_every=30, num_shards=2, cpus_per_shard=0.5, quiet=True)
    rows = run(config)
    assert [(row["round"], row["stage"]) for row in rows] == [(0, "train"), (30, "train"), (60, "train"), (61, "calibrated")]
    assert rows[-1]["accuracy"] >= rows[-2]["accuracy"], "calibration does not reduce accuracy on a label-skewed split"

    federation = load_federation(SKEWED)
    projection_floats = (24 + 1) * 16
    assert rows[-2]["bytes_up"] == rows[-2]["bytes_down"] == 60 * 10 * projection_floats * 4, "the classifier never travels"
    held = float(federation.client_num_classes.sum())
    assert rows[-1]["bytes_up"] - rows[-2]["bytes_up"] == (held * 16 + federation.num_clients * 16 * 16) * 4

    with np.load(out / "classifier.npz") as arrays:
        weight, bias, calibrated = (torch.from_numpy(arrays[k]) for k in ("proj_weight", "proj_bias", "W"))
        fixed = torch.from_numpy(arrays["fixed_classifier"])
    assert fixed.shape == (60, 16) and calibrated.shape == (16, 60)
    sample_ids, labels, _ = federation.train_arrays(0, federation.num_clients)
    x = federation.source.features("train", sample_ids).double()
    z = torch.nn.functional.normalize(x @ weight.double().T + bias.double(), dim=1)
    y = torch.nn.functional.one_hot(torch.from_numpy(labels.astype(np.int64)), 60).double()
    expected = torch.linalg.solve(z.T @ z + config.lam * torch.eye(16, dtype=torch.float64), z.T @ y)
    assert float((calibrated - expected).norm() / expected.norm()) <= 1e-8


def test_spherefed_options_are_checked():
    with pytest.raises(FedrayError, match="--head sphere"):
        RunConfig(method="scaffold", head="sphere").validate()
    with pytest.raises(FedrayError, match="--sphere-loss"):
        RunConfig(method="fedavg", head="sphere", sphere_loss="hinge").validate()
