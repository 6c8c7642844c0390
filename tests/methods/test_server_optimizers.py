"""Server optimizers against their update rules written out by hand over three rounds."""

import numpy as np
import pytest
import torch

from fedray.core.errors import FedrayError
from fedray.methods.training.server import (SERVER_OPTIMIZERS, ServerAdagrad, ServerAdam, ServerMomentum,
                                           ServerOptimizer, ServerSGD, ServerYogi)
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


# Reddi et al.'s Algorithm 2 in float64 at options other than the defaults, m and v from 0. The first Δ is zero in
# its last coordinate (v stays 0 there until a non-zero Δ comes), and the second smaller than the first, so that Yogi's
# v moves down (v > Δ²) as well as up.
ADAPTIVE_DELTAS = [torch.tensor(delta, dtype=torch.float64)
                   for delta in ([4.0, -2.0, 0.0], [0.5, 0.25, 3.0], [-1.0, 4.0, -0.5])]
ADAPTIVE_OPTIONS = {"server_lr": 0.1, "adam_beta1": 0.8, "adam_tau": 1e-2}


def run_adaptive(optimizer: ServerOptimizer) -> list[torch.Tensor]:
    """θ after each of the three steps from θ₀ = (0, 1, −1), the engine's tensors left as they were."""
    params, thetas = {"w": torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64)}, []
    for delta in ADAPTIVE_DELTAS:
        before = params["w"].clone()
        params_after = optimizer.step(params, {"w": delta.clone()})
        assert torch.equal(params["w"], before)
        params = params_after
        thetas.append(params["w"])
    return thetas


def plain_adaptive(second_moment) -> list[torch.Tensor]:
    theta, m, v, thetas = torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64), 0.0, 0.0, []
    for delta in ADAPTIVE_DELTAS:
        m = 0.8 * m + 0.2 * delta
        v = second_moment(v, delta)
        theta = theta + 0.1 * m / (torch.sqrt(v) + 0.01)
        thetas.append(theta)
    return thetas


def assert_steps_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for step, (a, e) in enumerate(zip(actual, expected, strict=True), start=1):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=lambda text: f"step {step}: {text}")


def test_fedadagrad_follows_reddi_et_al():
    assert_steps_equal(run_adaptive(ServerAdagrad(**ADAPTIVE_OPTIONS)), plain_adaptive(lambda v, delta: v + delta**2))


def test_fedyogi_follows_reddi_et_al():
    signs = []

    def yogi(v, delta):
        signs.append(torch.sign(v - delta**2))
        return v - (1 - 0.95) * delta**2 * torch.sign(v - delta**2)

    expected = plain_adaptive(yogi)
    assert (torch.stack(signs) > 0).any() and (torch.stack(signs) < 0).any(), "v moved both ways"
    assert_steps_equal(run_adaptive(ServerYogi(**ADAPTIVE_OPTIONS, adam_beta2=0.95)), expected)
    adam = plain_adaptive(lambda v, delta: 0.95 * v + 0.05 * delta**2)
    assert not torch.allclose(adam[-1], expected[-1], rtol=1e-3), "Yogi's v is not Adam's"


def test_fedadam_at_other_options_follows_reddi_et_al_to_float64_round_off():
    expected = plain_adaptive(lambda v, delta: 0.95 * v + 0.05 * delta**2)
    assert_steps_equal(run_adaptive(ServerAdam(**ADAPTIVE_OPTIONS, adam_beta2=0.95)), expected)


def flower_fedadam(server_lr: float, beta_1: float, beta_2: float, tau: float) -> list[np.ndarray]:
    """Flower 1.x's FedAdam.aggregate_fit (flwr/server/strategy/fedadam.py), its server rounds numbered from 1."""
    current_weights, m_t, v_t, thetas = np.array([0.0, 1.0, -1.0]), None, None, []
    for server_round, delta in enumerate(ADAPTIVE_DELTAS, start=1):
        delta_t = delta.numpy()
        m_t = np.zeros_like(delta_t) if m_t is None else m_t
        m_t = np.multiply(beta_1, m_t) + (1 - beta_1) * delta_t
        v_t = np.zeros_like(delta_t) if v_t is None else v_t
        v_t = beta_2 * v_t + (1 - beta_2) * np.multiply(delta_t, delta_t)
        eta_norm = (server_lr * np.sqrt(1 - np.power(beta_2, server_round + 1.0))
                    / (1 - np.power(beta_1, server_round + 1.0)))
        current_weights = current_weights + eta_norm * m_t / (np.sqrt(v_t) + tau)
        thetas.append(current_weights)
    return thetas


def test_fedadam_with_bias_correction_is_flowers_fedadam():
    adam = ServerAdam(**ADAPTIVE_OPTIONS, adam_beta2=0.95, adam_bias_correction=True)
    expected = flower_fedadam(server_lr=0.1, beta_1=0.8, beta_2=0.95, tau=1e-2)
    assert_steps_equal(run_adaptive(adam), [torch.from_numpy(theta) for theta in expected])
    uncorrected = plain_adaptive(lambda v, delta: 0.95 * v + 0.05 * delta**2)
    assert not torch.allclose(uncorrected[0], torch.from_numpy(expected[0]), rtol=1e-3), "the correction changes a step"


def test_the_bias_correction_counts_steps_across_a_checkpoint():
    options = {**ADAPTIVE_OPTIONS, "adam_beta2": 0.95, "adam_bias_correction": True}
    first = ServerAdam(**options)
    params = first.step({"w": torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64)}, {"w": ADAPTIVE_DELTAS[0].clone()})
    resumed = ServerAdam(**options)
    resumed.state = {name: dict(slots) for name, slots in first.state.items()}
    for delta in ADAPTIVE_DELTAS[1:]:
        params = resumed.step(params, {"w": delta.clone()})
    expected = flower_fedadam(server_lr=0.1, beta_1=0.8, beta_2=0.95, tau=1e-2)[-1]
    torch.testing.assert_close(params["w"], torch.from_numpy(expected), rtol=1e-12, atol=1e-12)


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
        "adam_bias_correction: bool = False  (Flower's FedAdam bias correction: step t moves by "
        "η √(1 − β₂^(t+1)) / (1 − β₁^(t+1)))",
    ]
    assert (ServerSGD().server_lr, ServerAdam().server_lr) == (1.0, 0.01)
    # Adagrad's v has no β₂; Yogi's options are Adam's, by the same names
    assert list(options_of(ServerAdagrad)) == ["server_lr", "adam_beta1", "adam_tau"]
    assert options_of(ServerYogi) == options_of(ServerAdam)
    assert (ServerAdagrad().server_lr, ServerYogi().server_lr) == (0.01, 0.01)
    assert (SERVER_OPTIMIZERS["fedadagrad"], SERVER_OPTIMIZERS["fedyogi"]) == (ServerAdagrad, ServerYogi)


def test_bad_settings_are_named():
    with pytest.raises(FedrayError, match="--server-lr must be > 0"):
        ServerSGD(server_lr=0)
