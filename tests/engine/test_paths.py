"""An algorithm means one thing on every path: a built-in trained in the dual form of linear heads, and the same
algorithm trained by autograd (a plugin's subclass of it, which the dual form does not take), give the same classifier
to round-off over several rounds, server optimizers and client states included."""

from dataclasses import dataclass

import numpy as np
import pytest

from fedray.engine.run_config import run
from fedray.engine.config import resolve
from fedray.methods.training_algorithms import FedAvg, FedProx, Scaffold

DATASET = "synthetic:inat-geo-100?dim=12&scale=0.2&classes=10"


def by_autograd(cls: type) -> type:
    """``cls`` as a plugin's subclass (``NameByAutograd`` here): the same algorithm, which the dual form does not take."""
    return dataclass(frozen=True)(type(f"{cls.__name__}ByAutograd", (cls,), {"__module__": __name__}))


FedAvgByAutograd, FedProxByAutograd, ScaffoldByAutograd = map(by_autograd, (FedAvg, FedProx, Scaffold))


def classifier(tmp_path, name: str, method: str, **values) -> dict[str, np.ndarray]:
    config = resolve({}, {"method": method, "dataset": DATASET, "out": str(tmp_path / name), "clients_per_round": 6,
                          "rounds": 4, "eval_every": 2, "client_lr": 0.05, "local_epochs": 2, "batch_size": 8,
                          "client_momentum": 0.5, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True, **values})
    completed = run(config)
    return completed.arrays


@pytest.mark.parametrize("method, values", [
    pytest.param("fedavg", {}, marks=pytest.mark.slow), pytest.param("fedavgm", {}, marks=pytest.mark.slow),
    pytest.param("fedadam", {"server_lr": 0.01}, marks=pytest.mark.slow),
    pytest.param("fedprox", {"options": {"prox_mu": 0.1}}, marks=pytest.mark.slow), ("scaffold", {})])
def test_the_dual_form_and_autograd_train_the_same_classifier(ray_session, tmp_path, method, values):
    plugin = {"fedavg": "FedAvg", "fedavgm": "FedAvg", "fedadam": "FedAvg", "fedprox": "FedProx", "scaffold": "Scaffold"}
    own = {"server_optimizer": method} if method in ("fedavgm", "fedadam") else {}  # FedAvg with their optimizer
    dual = classifier(tmp_path, "dual", method, **values)
    autograd = classifier(tmp_path, "autograd", f"{__name__}:{plugin[method]}ByAutograd", **values, **own)
    for key in ("W", "bias"):
        scale = float(np.abs(dual[key]).max())
        assert np.abs(autograd[key] - dual[key]).max() <= 1e-5 * scale, key   # float32 heads, sums in other orders
    start = classifier(tmp_path, "start", method, **{**values, "rounds": 1, "client_lr": 1e-12})
    assert np.abs(dual["W"] - start["W"]).max() > 1e-2 * float(np.abs(start["W"]).max()), "the heads moved"
