"""FedDyn and FedNova (shipped as plugins) equal plain references written out here, on a small federation whose
mini-batches the reference rebuilds exactly (the same permutations from the same seeds)."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedray.engine.config import resolve
from fedray.data.registry import load_federation
from fedray.engine.run_config import run
from fedray.core.errors import FedrayError
from fedray.engine.settings import training_algorithm
from fedray.runtime import sampling

DATASET = "synthetic:inat-geo-100?dim=8&scale=0.2&classes=6"
SEED, LR, ROUNDS, PER_ROUND = 4, 0.05, 4, 6


def engine_head(tmp_path, method: str, batch_size: int, epochs: int, **options) -> dict[str, np.ndarray]:
    out = tmp_path / method.rpartition(":")[2]
    config = resolve({}, {"method": method, "dataset": DATASET, "out": str(out), "seed": SEED,
                          "client_lr": LR, "weight_decay": 0.0, "batch_size": batch_size, "local_epochs": epochs,
                          "rounds": ROUNDS, "clients_per_round": PER_ROUND, "eval_every": ROUNDS, "num_shards": 2,
                          "cpus_per_shard": 0.5, "quiet": True, "options": options})
    run(config)
    saved = np.load(out / "classifier.npz")
    return {"weight": saved["W"], "bias": saved["bias"]}


def clients_data():
    federation = load_federation(DATASET)
    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    features = federation.source.features("train", sample_ids)
    labels = torch.from_numpy(labels.astype(np.int64))
    data = [(features[offsets[k]:offsets[k + 1]], labels[offsets[k]:offsets[k + 1]]) for k in range(federation.num_clients)]
    rounds = sampling.schedule(federation.num_clients, PER_ROUND, True, SEED, ROUNDS, past_coverage=True)
    return federation, data, rounds


def initial_head(dim: int, classes: int) -> dict[str, torch.Tensor]:
    """nn.Linear's U(±1/√d) from the run's seed: weight (d × C) first, then bias."""
    generator = torch.Generator().manual_seed(SEED)
    bound = 1 / math.sqrt(dim)
    weight = torch.empty(dim, classes).uniform_(-bound, bound, generator=generator)
    return {"weight": weight, "bias": torch.empty(classes).uniform_(-bound, bound, generator=generator)}


def batches(n: int, batch_size: int, epochs: int, round_number: int, client: int) -> list[np.ndarray]:
    """A fresh permutation of the client's samples per epoch, cut into batches, from (seed, round, client)."""
    rng = np.random.default_rng((SEED, round_number, client))
    out = []
    for _ in range(epochs):
        order = rng.permutation(n)
        out += [order[start:start + batch_size] for start in range(0, n, batch_size)]
    return out


def local_sgd(head, x, y, steps, extra=lambda theta: 0.0):
    """Plain SGD on the mean cross-entropy (+ ``extra``) from ``head``; the trained head."""
    theta = {name: value.clone().requires_grad_() for name, value in head.items()}
    optimizer = torch.optim.SGD(list(theta.values()), lr=LR)
    for step in steps:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x[step] @ theta["weight"] + theta["bias"], y[step]) + extra(theta)
        loss.backward()
        optimizer.step()
    return {name: value.detach() for name, value in theta.items()}


def test_feddyn_equals_algorithm_1_of_acar_et_al(ray_session, tmp_path):
    alpha = 0.1
    federation, data, rounds = clients_data()
    theta = initial_head(federation.dim, federation.num_classes)
    gradients: dict[int, dict[str, torch.Tensor]] = {}
    h = {name: torch.zeros_like(value) for name, value in theta.items()}
    for number, clients in enumerate(rounds, start=1):
        changes = []
        for client in clients.tolist():
            x, y = data[client]
            g = gradients.get(client, {name: torch.zeros_like(value) for name, value in theta.items()})

            def dynamic(params, g=g):   # − ⟨∇L_k(θ_k^{t−1}), θ⟩ + (α/2)‖θ − θ^{t−1}‖²
                return sum(-(g[name] * params[name]).sum() + alpha / 2 * ((params[name] - theta[name]) ** 2).sum()
                           for name in params)

            trained = local_sgd(theta, x, y, batches(len(y), 1000, 2, number, client), dynamic)
            change = {name: trained[name] - theta[name] for name in theta}
            gradients[client] = {name: g[name] - alpha * change[name] for name in theta}
            changes.append(change)
        mean = {name: sum(change[name] for change in changes) / len(changes) for name in theta}
        h = {name: h[name] - alpha * sum(change[name] for change in changes) / federation.num_clients for name in theta}
        theta = {name: theta[name] + mean[name] - h[name] / alpha for name in theta}
    head = engine_head(tmp_path, "feddyn", 1000, 2, alpha=alpha)
    for name in theta:
        np.testing.assert_allclose(head[name], theta[name].numpy(), rtol=1e-5, atol=1e-6)


def test_fednova_normalizes_each_update_by_its_local_steps(ray_session, tmp_path):
    batch_size, epochs = 3, 2
    federation, data, rounds = clients_data()
    sizes = federation.client_sizes
    assert len({math.ceil(sizes[k] / batch_size) for k in np.concatenate(rounds)}) > 1, "local steps differ"
    theta = initial_head(federation.dim, federation.num_classes)
    for number, clients in enumerate(rounds, start=1):
        p = sizes[clients] / sizes[clients].sum()
        normalized, steps = [], []
        for client in clients.tolist():
            x, y = data[client]
            plan = batches(len(y), batch_size, epochs, number, client)
            trained = local_sgd(theta, x, y, plan)
            normalized.append({name: (trained[name] - theta[name]) / len(plan) for name in theta})
            steps.append(len(plan))
        effective = float(np.dot(p, steps))   # τ_eff = Σ p_k τ_k
        theta = {name: theta[name] + effective * sum(float(pk) * d[name] for pk, d in zip(p, normalized)) for name in theta}
    head = engine_head(tmp_path, "fednova", batch_size, epochs)
    for name in theta:
        np.testing.assert_allclose(head[name], theta[name].numpy(), rtol=1e-5, atol=1e-6)
    fedavg = engine_head(tmp_path, "fedavg", batch_size, epochs)
    assert np.abs(fedavg["weight"] - head["weight"]).max() > 1e-3, "FedNova is not FedAvg when local steps differ"


def test_feddyn_takes_its_option_from_the_command_line_and_refuses_a_non_positive_alpha():
    assert training_algorithm(resolve({}, {"method": "feddyn", "options": {"alpha": "0.5"}})).alpha == 0.5
    with pytest.raises(FedrayError, match="--method feddyn: option alpha must be > 0, got 0.0"):
        training_algorithm(resolve({}, {"method": "feddyn", "options": {"alpha": "0"}}))


def test_the_readme_s_feddyn_in_one_file_trains_as_the_shipped_one(ray_session, tmp_path):
    readme = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    code = readme.split("# my_feddyn.py\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_feddyn.py").write_text(code)
    shipped = engine_head(tmp_path, "feddyn", 4, 2, alpha=0.1)
    mine = engine_head(tmp_path, f"{tmp_path / 'my_feddyn.py'}:MyFedDyn", 4, 2, alpha=0.1)
    assert all(np.array_equal(mine[name], shipped[name]) for name in shipped)
