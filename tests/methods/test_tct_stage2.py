"""TCT stage 2: the normalization round, the SCAFFOLD solver's invariants, and the closed form, all with the bias.

The references write the bias out as the paper's Algorithm 2 has it: predictions
Z̃W + 1bᵀ, i.e. least squares on the design [Z̃, 1] (``design``), models
ψ = [W; bᵀ] with the bias as the last row.
"""

import numpy as np
import pytest
import torch

from fedray.core.errors import FedrayError
from fedray.methods import tct_stage2 as stage2
from fedray.methods.tct_stage2 import STD_FLOOR, normalize, random_projection, targets
from tests.methods.tct_stage2_reference import ClientData, ScaffoldStage2, client_weights, closed_form_stage2, normalization, scaffold_stage2, standardize_clients
from tests.threads import on_threads

NUM_CLASSES = 4


def label_skewed(seed: int = 0, num_clients: int = 6, dim: int = 20) -> list[ClientData]:
    """Client k draws 90% of its labels from class k mod C; features are class mean + noise, off-center and scaled."""
    generator = torch.Generator().manual_seed(seed)
    means = torch.randn(NUM_CLASSES, dim, generator=generator, dtype=torch.float64)
    scales = torch.linspace(0.5, 3.0, dim, dtype=torch.float64)
    clients = []
    for k in range(num_clients):
        probs = torch.full((NUM_CLASSES,), 0.1 / (NUM_CLASSES - 1), dtype=torch.float64)
        probs[k % NUM_CLASSES] = 0.9
        labels = torch.multinomial(probs, 60 + 10 * k, replacement=True, generator=generator)
        noise = torch.randn(len(labels), dim, generator=generator, dtype=torch.float64)
        clients.append(ClientData((means[labels] + noise) * scales + 3.0, labels))
    return clients


@pytest.fixture(scope="module")
def problem() -> list[ClientData]:
    clients, _, _ = standardize_clients(label_skewed())
    return clients


def pooled(clients: list[ClientData]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([c.features for c in clients]), torch.cat([c.labels for c in clients])


def design(features: torch.Tensor) -> torch.Tensor:
    """[Z, 1]: the features and the bias's constant coordinate."""
    return torch.cat([features, torch.ones(len(features), 1, dtype=features.dtype)], dim=1)


def stable_lr(clients: list[ClientData]) -> float:
    """Half the inverse of the largest local curvature (of W and b): every client's local GD is a contraction."""
    return 0.5 / max(torch.linalg.eigvalsh(design(c.features).T @ design(c.features) / len(c.features)).max().item() for c in clients)


def objective_gradient(clients: list[ClientData], weights: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """∇F of ψ = [W; bᵀ]: Σ_k w_k [Z_k, 1]ᵀ (Z_k W + 1bᵀ − Y_k) / n_k."""
    return sum(
        w * design(c.features).T @ (c.features @ model[:-1] + model[-1] - targets(c.labels, NUM_CLASSES)) / len(c.labels)
        for w, c in zip(weights.tolist(), clients)
    )


def test_normalization_from_client_sums_equals_centralized():
    clients = label_skewed(seed=1)
    features, _ = pooled(clients)
    mean, std = normalization(clients)
    assert torch.allclose(mean, features.mean(dim=0), rtol=0, atol=1e-10)
    assert torch.allclose(std, features.std(dim=0, correction=0), rtol=0, atol=1e-10)
    standardized, _ = pooled(standardize_clients(clients)[0])
    assert torch.allclose(standardized, (features - features.mean(dim=0)) / features.std(dim=0, correction=0), atol=1e-10)


def test_constant_coordinate_is_centered_not_divided_by_zero():
    features = torch.tensor([[1.0, 5.0], [2.0, 5.0], [4.0, 5.0]], dtype=torch.float64)
    clients = [ClientData(features[:1], torch.tensor([0])), ClientData(features[1:], torch.tensor([1, 0]))]
    mean, std = normalization(clients)
    assert std[1] == STD_FLOOR
    assert torch.all(normalize(features, mean, std)[:, 1] == 0)


def test_targets_are_centered_one_hot():
    y = targets(torch.tensor([2, 0]), 4)
    assert torch.equal(y, torch.tensor([[-0.25, -0.25, 0.75, -0.25], [0.75, -0.25, -0.25, -0.25]], dtype=torch.float64))


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("clients_per_round", [None, 3])
def test_control_variates_sum_to_zero_every_round(problem, weighted, clients_per_round):
    solver = ScaffoldStage2(problem, NUM_CLASSES, local_steps=5, lr=stable_lr(problem), clients_per_round=clients_per_round, weighted=weighted)
    weights = client_weights(problem, weighted)
    for _ in range(15):
        solver.step()
        assert solver.corrections().abs().max() > 1e-3
        assert torch.einsum("k,kpc->pc", weights, solver.corrections()).abs().max() <= 1e-10


def test_full_participation_control_is_derived_from_two_models(problem):
    """c⁺ = (W_t − W_{t+1}) / (Kη): why one model down per round is enough without sampling."""
    solver = ScaffoldStage2(problem, NUM_CLASSES, local_steps=7, lr=stable_lr(problem))
    for _ in range(10):
        before = solver.model
        solver.step()
        derived = (before - solver.model) / (solver.local_steps * solver.lr)
        assert torch.allclose(solver.control, derived, rtol=0, atol=1e-10 * derived.abs().max().item())


@pytest.mark.parametrize("weighted", [True, False])
def test_one_local_step_is_full_batch_gradient_descent(problem, weighted):
    lr = stable_lr(problem)
    solver = ScaffoldStage2(problem, NUM_CLASSES, local_steps=1, lr=lr, weighted=weighted)
    weights = client_weights(problem, weighted)
    model = torch.zeros(20 + 1, NUM_CLASSES, dtype=torch.float64)
    for _ in range(20):
        model = model - lr * objective_gradient(problem, weights, model)
        solver.step()
        assert solver.model.shape == (20 + 1, NUM_CLASSES)
        assert torch.allclose(solver.model, model, rtol=0, atol=1e-10)
    assert solver.model[-1].abs().max() > 1e-3, "the bias is trained"
    assert solver.corrections().abs().max() > 1e-3


def fedavg_fixed_point(clients: list[ClientData], local_steps: int, lr: float) -> torch.Tensor:
    """Where h_k = 0 converges: y_K = P_k ψ + q_k per client, so ψ = Σ w_k (P_k ψ + q_k)."""
    dim = clients[0].features.shape[1] + 1
    eye = torch.eye(dim, dtype=torch.float64)
    system, rhs = eye.clone(), torch.zeros(dim, NUM_CLASSES, dtype=torch.float64)
    for weight, c in zip(client_weights(clients, True).tolist(), clients):
        n, x = len(c.labels), design(c.features)
        step = eye - lr * x.T @ x / n
        offset = lr * x.T @ targets(c.labels, NUM_CLASSES) / n
        power, q = eye, torch.zeros_like(offset)
        for _ in range(local_steps):
            q = step @ q + offset
            power = step @ power
        system -= weight * power
        rhs += weight * q
    return torch.linalg.solve(system, rhs)


def test_scaffold_reaches_least_squares_where_local_gd_drifts(problem):
    lr, local_steps = stable_lr(problem), 10
    exact = closed_form_stage2(problem, NUM_CLASSES)
    model, history = scaffold_stage2(problem, NUM_CLASSES, rounds=100, local_steps=local_steps, lr=lr)
    assert (model - exact).norm() / exact.norm() < 1e-4
    features, labels = pooled(problem)
    least_squares = torch.linalg.lstsq(design(features), targets(labels, NUM_CLASSES)).solution
    assert (model[-1] - least_squares[-1]).norm() / least_squares[-1].norm() < 1e-4, "the bias converges too"
    plain, plain_history = scaffold_stage2(problem, NUM_CLASSES, rounds=100, local_steps=local_steps, lr=lr, correction=False)
    drift = fedavg_fixed_point(problem, local_steps, lr)
    assert (plain - drift).norm() / drift.norm() < 1e-5
    assert (drift - exact).norm() / exact.norm() > 0.05
    assert plain_history[-1].loss > history[-1].loss * 1.01


def test_history_records_objective_and_traffic(problem):
    evaluated = []
    model, history = scaffold_stage2(
        problem, NUM_CLASSES, rounds=3, local_steps=2, lr=0.01, evaluate=lambda w: evaluated.append(w) or {"norm": float(w.norm())}
    )
    features, labels = pooled(problem)
    scores = features @ model[:-1] + model[-1]
    assert history[-1].loss == pytest.approx(float((scores - targets(labels, NUM_CLASSES)).square().sum()) / (2 * len(labels)), rel=1e-12)
    assert history[-1].accuracy == pytest.approx(float((scores.argmax(dim=1) == labels).double().mean()))
    assert history[-1].metrics == {"norm": float(model.norm())} and len(evaluated) == 3
    floats = (20 + 1) * NUM_CLASSES
    assert (history[0].floats_up, history[0].floats_down) == (6 * floats, 6 * floats)
    _, sampled = scaffold_stage2(problem, NUM_CLASSES, rounds=2, local_steps=2, lr=0.01, clients_per_round=2, seed=3)
    assert [len(r.clients) for r in sampled] == [2, 2]
    assert (sampled[0].floats_up, sampled[0].floats_down) == (2 * floats, 4 * floats)


def test_closed_form_equals_pooled_lstsq(problem):
    features, labels = pooled(problem)
    expected = torch.linalg.lstsq(design(features), targets(labels, NUM_CLASSES)).solution
    solution = closed_form_stage2(problem, NUM_CLASSES)
    assert solution.shape == (20 + 1, NUM_CLASSES)
    assert (solution - expected).norm() / expected.norm() <= 1e-8
    assert torch.allclose(solution[-1], expected[-1], rtol=0, atol=1e-10)


def test_closed_form_bias_is_the_class_prior(problem):
    """Standardized features sum to 0 over all clients, so b = Ȳ (class frequencies − 1/C) and W is the fit without a bias."""
    features, labels = pooled(problem)
    frequencies = torch.bincount(labels, minlength=NUM_CLASSES).double() / len(labels)
    assert (frequencies - 1 / NUM_CLASSES).abs().max() > 0.05, "the label-skewed clients pool into imbalanced classes"
    without_bias = torch.linalg.lstsq(features, targets(labels, NUM_CLASSES)).solution
    for lam in (0.0, 0.3):
        solution = closed_form_stage2(problem, NUM_CLASSES, lam=lam)
        assert torch.allclose(solution[-1], frequencies - 1 / NUM_CLASSES, rtol=0, atol=1e-10), "λ leaves b alone"
    solution = closed_form_stage2(problem, NUM_CLASSES)
    assert torch.allclose(solution[:-1], without_bias, rtol=0, atol=1e-10)

    def residual(weights: torch.Tensor, bias: torch.Tensor | float) -> float:
        return float((features @ weights + bias - targets(labels, NUM_CLASSES)).square().sum())

    gain = residual(without_bias, 0.0) - residual(solution[:-1], solution[-1])
    assert gain == pytest.approx(len(labels) * float((frequencies - 1 / NUM_CLASSES).square().sum()), rel=1e-8), "N ‖Ȳ‖²"


def test_closed_form_ridge_and_rank_deficient(problem):
    features, labels = pooled(problem)
    x, y = design(features), targets(labels, NUM_CLASSES)
    lam = 0.3
    penalty = torch.diag(torch.tensor([1.0] * 20 + [0.0], dtype=torch.float64))  # W regularized, b not
    ridge = torch.linalg.solve(x.T @ x / len(labels) + lam * penalty, x.T @ y / len(labels))
    assert torch.allclose(closed_form_stage2(problem, NUM_CLASSES, lam=lam), ridge, rtol=0, atol=1e-10)
    wide = [ClientData(c.features[:2].repeat(1, 3), c.labels[:2]) for c in problem]
    wide_features, wide_labels = pooled(wide)
    minimum_norm = torch.linalg.pinv(design(wide_features)) @ targets(wide_labels, NUM_CLASSES)
    assert torch.allclose(closed_form_stage2(wide, NUM_CLASSES), minimum_norm, rtol=0, atol=1e-8)


def test_random_projection_is_shared_by_seed(problem):
    features, _ = pooled(problem)
    projected = random_projection(features, 8, seed=5)
    assert projected.shape == (len(features), 8)
    per_client = torch.cat([random_projection(c.features, 8, seed=5) for c in problem])
    assert torch.equal(per_client, projected)
    assert not torch.allclose(random_projection(features, 8, seed=6), projected)
    wide = torch.randn(50, 400, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ratio = random_projection(wide, 4000, seed=1).square().sum() / wide.square().sum()
    assert abs(ratio.item() - 1) < 0.05


def test_rejects_inconsistent_clients():
    with pytest.raises(FedrayError):
        ClientData(torch.zeros(3, 2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(FedrayError):
        ScaffoldStage2([ClientData(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)), ClientData(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))], 2)


def test_moments_accumulate_blocks_of_rows(monkeypatch):
    clients = label_skewed(seed=2)
    whole = normalization(clients)
    monkeypatch.setattr(stage2, "ROW_BLOCK", 7)
    assert len(stage2.row_blocks(60)) == 9
    blocked = normalization(clients)
    assert all(torch.allclose(a, b, rtol=1e-13, atol=0) for a, b in zip(whole, blocked))


def test_closed_form_loss_has_the_same_bits_on_one_and_two_threads():
    """The e2e sweep's closed form: 12 samples, p = 50, C = 3. The features fit the targets, so F at the minimizer is
    ~1e-17 of round-off, whose sign flipped with the driver's threads (1 in a Tune trial, the machine's otherwise)."""
    generator = torch.Generator().manual_seed(6)
    features = torch.randn(12, 50, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (12,), generator=generator)
    [client], _, _ = standardize_clients([ClientData(features, labels)])
    matrix, rhs = stage2.stage2_statistics(client.features, client.labels, 3)

    def model_and_loss() -> tuple[torch.Tensor, float]:
        model = stage2.solve_stage2(matrix, rhs, 12)
        return model, stage2.objective_from_statistics(matrix, rhs, 12, 3, model)

    (model_one, loss_one), (model_two, loss_two) = (on_threads(count, model_and_loss) for count in (1, 2))
    assert loss_one.hex() == loss_two.hex()
    assert abs(loss_one) < 1e-15
    assert torch.equal(model_one, model_two)


def test_client_loss_has_the_same_bits_on_one_and_two_threads():
    """A residual of 20,000 × 4 elements: torch sums more than 32,768 in per-thread chunks."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(20_000, 21, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (20_000,), generator=generator)
    model = torch.randn(21, NUM_CLASSES, generator=generator)
    target = targets(labels, NUM_CLASSES, torch.float32)
    one, two = (on_threads(count, lambda: stage2.client_loss(features, target, model)) for count in (1, 2))
    assert one.hex() == two.hex()


def test_cross_entropy_targets_are_one_hot():
    y = targets(torch.tensor([2, 0]), 4, loss="ce")
    assert torch.equal(y, torch.tensor([[0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64))


def test_cross_entropy_local_steps_equal_plain_softmax_gradient_descent(problem):
    """TCT-CE's client: M full-batch steps of softmax cross-entropy's gradient on [Z, 1], with SCAFFOLD's correction,
    against numpy; and its loss, the mean of logsumexp(s_i) − s_i,y_i."""
    client = problem[1]
    x, labels = design(client.features).numpy(), client.labels.numpy()
    generator = torch.Generator().manual_seed(9)
    model = torch.randn(21, NUM_CLASSES, generator=generator, dtype=torch.float64)
    correction = 0.1 * torch.randn(21, NUM_CLASSES, generator=generator, dtype=torch.float64)
    expected, onehot = model.numpy(), np.eye(NUM_CLASSES)[labels]
    for _ in range(30):
        scores = x @ expected
        probabilities = np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)
        expected = expected - 0.05 * (x.T @ (probabilities - onehot) / len(x) - correction.numpy())
    target = targets(client.labels, NUM_CLASSES, loss="ce")
    delta = stage2.local_delta(design(client.features), target, model, correction, 30, 0.05, loss="ce")
    assert np.allclose((model + delta).numpy(), expected, rtol=0, atol=1e-12)
    scores = x @ model.numpy()
    plain = float(np.mean(np.log(np.exp(scores).sum(axis=1)) - scores[np.arange(len(x)), labels]))
    assert stage2.client_loss(design(client.features), target, model, loss="ce") == pytest.approx(plain, rel=1e-13)
