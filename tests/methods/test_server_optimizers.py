"""Server optimizers against their update rules written out by hand over three rounds."""

import pytest
import torch

from fedray.core.errors import FedrayError
from fedray.methods.training.server import SERVER_OPTIMIZERS, ServerAdam, ServerMomentum, ServerOptimizer, ServerSGD
from fedray.core.options import options_of

DELTAS = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5]), torch.tensor([-1.0, 4.0])]


def run(optimizer: ServerOptimizer) -> torch.Tensor:
    params = {"w": torch.tensor([0.0, 1.0])}
    for delta in DELTAS:
        before = params["w"].clone()
        params_after = optimizer.step(params, {"w": delta.clone()})
        assert torch.equal(params["w"], before)  # the engine's tensors are not modified
        params = params_after
    return params["w"]


def test_fedavg_adds_the_scaled_average_update():
    torch.testing.assert_close(run(ServerSGD(server_lr=0.5)), torch.tensor([0.25, 2.25]))


def test_fedavgm_keeps_a_momentum_of_updates():
    m1 = DELTAS[0]
    m2 = 0.9 * m1 + DELTAS[1]
    m3 = 0.9 * m2 + DELTAS[2]
    expected = torch.tensor([0.0, 1.0]) + 1.0 * (m1 + m2 + m3)
    torch.testing.assert_close(run(ServerMomentum(server_lr=1.0, server_momentum=0.9)), expected)


def test_fedadam_follows_reddi_et_al():
    theta, m, v = torch.tensor([0.0, 1.0]), torch.zeros(2), torch.zeros(2)
    for delta in DELTAS:
        m = 0.9 * m + 0.1 * delta
        v = 0.99 * v + 0.01 * delta**2
        theta = theta + 0.01 * m / (v.sqrt() + 1e-3)
    torch.testing.assert_close(run(ServerAdam()), theta)


@pytest.mark.parametrize("name", sorted(SERVER_OPTIMIZERS))
def test_a_zero_update_on_a_fresh_optimizer_changes_nothing(name):
    params = SERVER_OPTIMIZERS[name]().step({"w": torch.tensor([3.0, -1.0])}, {"w": torch.zeros(2)})
    torch.testing.assert_close(params["w"], torch.tensor([3.0, -1.0]))


def test_options_are_the_constructor_arguments():
    assert [option.describe() for option in options_of(ServerAdam).values()] == [
        "server_lr: float | None = None  (server learning rate η (default 0.01))",
        "adam_beta1: float = 0.9  (β₁)",
        "adam_beta2: float = 0.99  (β₂)",
        "adam_tau: float = 0.001  (τ, the adaptivity floor)",
    ]
    assert (ServerSGD().server_lr, ServerAdam().server_lr) == (1.0, 0.01)


def test_bad_settings_are_named():
    with pytest.raises(FedrayError, match="--server-lr must be > 0"):
        ServerSGD(server_lr=0)
