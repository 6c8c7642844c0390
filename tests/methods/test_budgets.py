"""Per-client step budgets (a straggler's partial work) on linear heads: FedAvg and FedNova against their updates
written out plainly, no bit changed where no budget binds, bad budgets refused in one line."""

import numpy as np
import pytest
import torch

from fedray.algorithms.fednova import FedNova
from fedray.core.errors import FedrayError
from fedray.methods.algorithm import Population
from fedray.methods.base import ClientBatch
from fedray.methods.training.budgets import checked_budgets, full_steps
from fedray.methods.training.heads import ROWS, train_linear_heads
from fedray.methods.training.local import LocalSGD, client_rng, minibatches
from fedray.methods.training_algorithms import CONTROL, FedAvg, Scaffold

SIZES = np.array([3, 11, 7, 20, 1])
OFFSETS = np.concatenate([[0], np.cumsum(SIZES)])
CLIENTS = np.array([8, 2, 30, 5, 17])
SGD = LocalSGD(lr=0.1, weight_decay=1e-3, batch_size=4, epochs=2)
FULL = np.array([2, 6, 4, 10, 2])
"""epochs × ⌈n / batch size⌉ of SIZES, counted by hand."""
BUDGETS = np.array([2, 3, 1, 7, 5])
"""Binding for the 2nd, 3rd and 4th clients only."""
SEED, ROUND = 5, 4


class DictStates(dict):
    def put(self, client, state):
        if state is not None:
            self[client] = state


def problem():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(OFFSETS[-1], 8, generator=generator, dtype=torch.float64)
    labels = torch.randint(5, (OFFSETS[-1],), generator=generator)
    params = {"weight": 0.1 * torch.randn(8, 5, generator=generator, dtype=torch.float64),
              "bias": 0.1 * torch.randn(5, generator=generator, dtype=torch.float64)}
    return ClientBatch(features, labels, OFFSETS, CLIENTS), params


def plain_client(x, y, weight, bias, batches):
    """Mini-batch SGD of a softmax head written out in numpy: the mean cross-entropy's gradient plus weight decay
    (on the bias too, as torch.optim.SGD), one step per mini-batch."""
    w, b = weight.copy(), bias.copy()
    for batch in batches:
        logits = x[batch] @ w + b
        error = np.exp(logits - logits.max(axis=1, keepdims=True))
        error /= error.sum(axis=1, keepdims=True)
        error[np.arange(len(batch)), y[batch]] -= 1
        error /= len(batch)
        w, b = (w - SGD.lr * (x[batch].T @ error + SGD.weight_decay * w),
                b - SGD.lr * (error.sum(0) + SGD.weight_decay * b))
    return w, b


def plain_updates(batch, params, budgets):
    """Each client's (θ_k − θ) for weight and bias after the first ``budgets[k]`` of its mini-batches, and τ_k."""
    x, y = batch.features.numpy(), batch.labels.numpy()
    weight, bias = params["weight"].numpy(), params["bias"].numpy()
    updates, taken = [], []
    for k, client in enumerate(CLIENTS):
        rows = slice(OFFSETS[k], OFFSETS[k + 1])
        plan = minibatches(int(SIZES[k]), SGD.batch_size, SGD.epochs, client_rng(SEED, ROUND, int(client)))
        plan = plan[:budgets[k]]
        w, b = plain_client(x[rows], y[rows], weight, bias, plan)
        updates.append((w - weight, b - bias))
        taken.append(len(plan))
    return updates, np.array(taken)


def test_a_clients_full_steps_are_its_minibatches_over_all_epochs():
    assert full_steps(SIZES, SGD.batch_size, SGD.epochs).tolist() == FULL.tolist()
    assert full_steps(np.array([0, 1, 50, 51]), 50, 5).tolist() == [0, 5, 5, 10]


def test_fedavg_with_step_budgets_equals_a_plain_loop_weighted_by_the_clients_samples():
    batch, params = problem()
    [update] = train_linear_heads(batch, params, {}, SGD, FedAvg(), SEED, ROUND, DictStates(), steps=BUDGETS)
    updates, taken = plain_updates(batch, params, BUDGETS)
    assert taken.tolist() == [2, 3, 1, 7, 2]
    n = SIZES.astype(np.float64)
    assert update.weight == n.sum()  # a partial client keeps its weight n_k
    expected_w = sum(n[k] * updates[k][0] for k in range(len(CLIENTS))) / n.sum()
    expected_b = sum(n[k] * updates[k][1] for k in range(len(CLIENTS))) / n.sum()
    np.testing.assert_allclose((update.sums["weight"] / update.weight).numpy(), expected_w, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose((update.sums["bias"] / update.weight).numpy(), expected_b, rtol=1e-6, atol=1e-9)
    full, _ = plain_updates(batch, params, FULL)
    assert np.abs(sum(n[k] * full[k][0] for k in range(len(CLIENTS))) / n.sum() - expected_w).max() > 1e-3


def test_fednova_with_heterogeneous_budgets_is_its_papers_normalized_average_of_the_steps_taken():
    batch, params = problem()
    [update] = train_linear_heads(batch, params, {}, SGD, FedNova(), SEED, ROUND, DictStates(), steps=BUDGETS)
    population = Population(100, 1000)
    delta, _ = FedNova().server_update(params, update.aggregate(), {}, population)
    updates, tau = plain_updates(batch, params, BUDGETS)
    # Wang et al. (2020): d_k = (θ_k − θ)/τ_k, p_k = n_k/n, τ_eff = Σ p_k τ_k, Δ = τ_eff Σ p_k d_k
    p = SIZES / SIZES.sum()
    tau_eff = float(np.dot(p, tau))
    expected_w = tau_eff * sum(p[k] * updates[k][0] / tau[k] for k in range(len(CLIENTS)))
    expected_b = tau_eff * sum(p[k] * updates[k][1] / tau[k] for k in range(len(CLIENTS)))
    np.testing.assert_allclose(delta["weight"].numpy(), expected_w, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(delta["bias"].numpy(), expected_b, rtol=1e-6, atol=1e-9)
    fedavg = sum(p[k] * updates[k][0] for k in range(len(CLIENTS)))
    assert np.abs(fedavg - expected_w).max() > 1e-3, "FedNova is not FedAvg when the steps taken differ"


def test_scaffold_option_ii_forms_its_new_control_variate_from_the_steps_taken():
    batch, params = problem()
    generator = torch.Generator().manual_seed(1)
    control = {CONTROL + name: 0.1 * torch.randn(value.shape, generator=generator, dtype=torch.float64)
               for name, value in params.items()}
    states = DictStates()
    train_linear_heads(batch, params, control, SGD, Scaffold(variant="II"), SEED, ROUND, states, steps=BUDGETS)
    x, y = batch.features.numpy(), batch.labels.numpy()
    c_w, c_b = control[CONTROL + "weight"].numpy(), control[CONTROL + "bias"].numpy()
    for k, client in enumerate(CLIENTS.tolist()):
        rows = slice(OFFSETS[k], OFFSETS[k + 1])
        plan = minibatches(int(SIZES[k]), SGD.batch_size, SGD.epochs, client_rng(SEED, ROUND, client))[:BUDGETS[k]]
        w, b = params["weight"].numpy(), params["bias"].numpy()
        for batch_rows in plan:  # c_i = 0 at a first participation: every gradient corrected by c
            logits = x[rows][batch_rows] @ w + b
            error = np.exp(logits - logits.max(axis=1, keepdims=True))
            error /= error.sum(axis=1, keepdims=True)
            error[np.arange(len(batch_rows)), y[rows][batch_rows]] -= 1
            error /= len(batch_rows)
            w = w - SGD.lr * (x[rows][batch_rows].T @ error + SGD.weight_decay * w + c_w)
            b = b - SGD.lr * (error.sum(0) + SGD.weight_decay * b + c_b)
        # c_i⁺ = c_i − c + (θ⁰ − θ_i)/(τ_i η), τ_i the steps taken
        expected = -c_w + (params["weight"].numpy() - w) / (len(plan) * SGD.lr)
        np.testing.assert_allclose(states[client][CONTROL + "weight"].numpy(), expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("algorithm, momentum", [(FedAvg(), 0.0), (FedAvg(), 0.9), (Scaffold(), 0.0), (FedNova(), 0.0)])
def test_budgets_that_do_not_bind_change_no_bit(algorithm, momentum):
    batch, params = problem()
    generator = torch.Generator().manual_seed(1)
    broadcast, rows = {}, {}
    if isinstance(algorithm, Scaffold):  # c and each client's c_i = X_iᵀ G_i (the dual form's state: G_i)
        broadcast = {CONTROL + name: 0.1 * torch.randn(value.shape, generator=generator, dtype=torch.float64)
                     for name, value in params.items()}
        rows = {client: {ROWS: 0.1 * torch.randn(int(n), 5, generator=generator, dtype=torch.float64)}
                for client, n in zip(CLIENTS.tolist(), SIZES)}
    sgd = LocalSGD(lr=0.1, weight_decay=1e-3, batch_size=4, epochs=2, momentum=momentum)
    rounds = [train_linear_heads(batch, params, broadcast, sgd, algorithm, SEED, ROUND, DictStates(rows), steps=steps)[0]
              for steps in (None, FULL, FULL + np.array([0, 1, 0, 9, 100]))]
    for other in rounds[1:]:
        assert other.weight == rounds[0].weight and other.loss_sum == rounds[0].loss_sum
        assert all(torch.equal(other.sums[name], rounds[0].sums[name]) for name in rounds[0].sums)


@pytest.mark.parametrize("steps, message", [
    (np.array([1, 2]), "need one count per client: 5 clients, got 2 budgets"),
    (np.array([1, 2, -1, 4, 5]), r"must be ≥ 1 .*got -1 for client 30"),
    (np.array([1, 0, 3, 4, 5]), r"≥ 1 \(a straggler with no step done is dropped, not trained\), got 0 for client 2"),
    (np.array([1, 2, 2.5, 4, 5]), "must be whole numbers of steps"),
    (np.array([1, 2, np.nan, 4, 5]), "must be whole numbers of steps"),
    (np.array([1, 2, np.inf, 4, 5]), "must be whole numbers of steps"),
])
def test_bad_budgets_are_refused_in_one_line(steps, message):
    with pytest.raises(FedrayError, match=message) as error:
        checked_budgets(steps, CLIENTS)
    assert "\n" not in str(error.value)


def test_whole_budgets_are_taken_as_step_counts():
    assert checked_budgets(None, CLIENTS) is None
    assert checked_budgets(np.array([1.0, 2.0, 3.0, 4.0, 5.0]), CLIENTS).dtype == np.int64


def test_a_scaffold_clients_first_round_in_float64_starts_from_zero_rows_of_the_models_dtype():
    """A client with no state yet starts from c_i = 0 (zero dual rows): in a float64 run they are float64 zeros, the
    same bits as zero rows stored beforehand (they were float32, and the dual form's product refused the mix)."""
    batch, params = problem()
    generator = torch.Generator().manual_seed(1)
    broadcast = {CONTROL + name: 0.1 * torch.randn(value.shape, generator=generator, dtype=torch.float64)
                 for name, value in params.items()}
    zeros = {client: {ROWS: torch.zeros(int(n), 5, dtype=torch.float64)} for client, n in zip(CLIENTS.tolist(), SIZES)}
    first, stored = (train_linear_heads(batch, params, broadcast, SGD, Scaffold(), SEED, ROUND, DictStates(rows))[0]
                     for rows in ({}, zeros))
    assert all(torch.equal(first.sums[name], stored.sums[name]) for name in stored.sums)
