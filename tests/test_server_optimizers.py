"""Server optimizers against their update rules written out by hand over three rounds."""

import pytest
import torch

from fedray.gradient.server import ServerOptimizer

DELTAS = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5]), torch.tensor([-1.0, 4.0])]


def run(optimizer: ServerOptimizer) -> torch.Tensor:
    params = {"w": torch.tensor([0.0, 1.0])}
    for delta in DELTAS:
        optimizer.step(params, {"w": delta.clone()})
    return params["w"]


def test_fedavg_adds_the_scaled_average_update():
    torch.testing.assert_close(run(ServerOptimizer("fedavg", lr=0.5)), torch.tensor([0.25, 2.25]))


def test_fedavgm_keeps_a_momentum_of_updates():
    m1 = DELTAS[0]
    m2 = 0.9 * m1 + DELTAS[1]
    m3 = 0.9 * m2 + DELTAS[2]
    expected = torch.tensor([0.0, 1.0]) + 1.0 * (m1 + m2 + m3)
    torch.testing.assert_close(run(ServerOptimizer("fedavgm", lr=1.0, momentum=0.9)), expected)


def test_fedadam_follows_reddi_et_al():
    theta, m, v = torch.tensor([0.0, 1.0]), torch.zeros(2), torch.zeros(2)
    for delta in DELTAS:
        m = 0.9 * m + 0.1 * delta
        v = 0.99 * v + 0.01 * delta**2
        theta = theta + 0.01 * m / (v.sqrt() + 1e-3)
    torch.testing.assert_close(run(ServerOptimizer("fedadam", lr=0.01)), theta)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedavgm", "fedadam"])
def test_a_zero_update_on_a_fresh_optimizer_changes_nothing(algorithm):
    params = {"w": torch.tensor([3.0, -1.0])}
    ServerOptimizer(algorithm).step(params, {"w": torch.zeros(2)})
    torch.testing.assert_close(params["w"], torch.tensor([3.0, -1.0]))


def test_bad_settings_are_named():
    from fedray.errors import FedrayError

    with pytest.raises(FedrayError, match="unknown server optimizer 'fedyogi'"):
        ServerOptimizer("fedyogi")
    with pytest.raises(FedrayError, match="must be > 0"):
        ServerOptimizer("fedavg", lr=0)
