"""SphereFed on features: training moves only the projection, FFC calibration is the exact least squares and helps."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from fedray.engine.config import RunConfig
from fedray.data.registry import load_federation
from fedray.core.errors import FedrayError
from fedray.methods.training.local import client_rng, minibatches, random_head
from fedray.engine.run_config import run
from fedray.runtime import sampling
from fedray.methods.sphere import fixed_classifier

SKEWED = "synthetic:inat-user-120k?dim=24&scale=0.04&classes=60&seed=3&split=dirichlet&alpha=0.1&clients=50"


@pytest.mark.slow
def test_spherefed_trains_the_projection_then_calibrates_to_the_least_squares_solution(ray_session, tmp_path):
    out = tmp_path / "sphere"
    config = RunConfig(method="fedavg", head="sphere", sphere_dim=16, client_lr=0.5, dataset=SKEWED, out=str(out),
                       rounds=60, eval_every=30, num_shards=2, cpus_per_shard=0.5, quiet=True)
    rows = run(config).rows
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


SMALL = "synthetic:inat-user-120k?dim=12&scale=0.01&classes=8&seed=1&split=dirichlet&alpha=0.3&clients=12"


def plain_sphere_scaffold(federation, config, rounds, lrs=None):
    """SCAFFOLD option II on SphereFed's projection written plainly: one torch.optim.SGD per client, dense c_i.

    ``lrs``: the client learning rate of each round (default ``config.client_lr`` throughout).
    """
    dim, sphere_dim, classes = federation.dim, config.sphere_dim, federation.num_classes
    head = random_head(dim, sphere_dim, config.seed)
    weight, bias = head["weight"].T.contiguous(), head["bias"]
    classifier = fixed_classifier(classes, sphere_dim, config.seed).float()
    control = [torch.zeros_like(weight), torch.zeros_like(bias)]
    own = {}
    sizes, total = federation.client_sizes, int(federation.client_sizes.sum())
    for number, clients in enumerate(rounds, start=1):
        lr = config.client_lr if lrs is None else lrs[number - 1]
        delta, weights, change = [torch.zeros_like(weight), torch.zeros_like(bias)], 0, [torch.zeros_like(weight), torch.zeros_like(bias)]
        for client in clients.tolist():
            sample_ids, labels, _ = federation.train_arrays(client, client + 1)
            x, y = federation.source.features("train", sample_ids).float(), torch.from_numpy(labels.astype(np.int64))
            mine = own.get(client, [torch.zeros_like(weight), torch.zeros_like(bias)])
            p, q = weight.clone().requires_grad_(), bias.clone().requires_grad_()
            optimizer = torch.optim.SGD([p, q], lr=lr, weight_decay=config.weight_decay, momentum=config.client_momentum)
            steps = minibatches(len(y), config.batch_size, config.local_epochs, client_rng(config.seed, number, client))
            for batch in steps:
                optimizer.zero_grad()
                z = torch.nn.functional.normalize(x[batch] @ p.T + q, dim=1)
                target = torch.nn.functional.one_hot(y[batch], classes).float()
                ((z @ classifier.T - target) ** 2).mean(dim=1).mean().backward()
                p.grad += control[0] - mine[0]
                q.grad += control[1] - mine[1]
                optimizer.step()
            new = [mine[0] - control[0] + (weight - p.detach()) / (len(steps) * lr),
                   mine[1] - control[1] + (bias - q.detach()) / (len(steps) * lr)]
            for i in range(2):
                change[i] += sizes[client] / total * (new[i] - mine[i])
                delta[i] += sizes[client] * ((p, q)[i].detach() - (weight, bias)[i])
            own[client] = new
            weights += sizes[client]
        weight, bias = weight + delta[0] / weights, bias + delta[1] / weights
        control = [control[0] + change[0], control[1] + change[1]]
    return weight, bias


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_spherefed_with_scaffold_on_features_equals_plain_scaffold(ray_session, tmp_path):
    out = tmp_path / "sphere-scaffold"
    config = RunConfig(method="scaffold", variant="II", head="sphere", sphere_dim=6, client_lr=0.2, batch_size=4, local_epochs=2,
                       clients_per_round=4, dataset=SMALL, out=str(out), rounds=5, eval_every=5, num_shards=2,
                       cpus_per_shard=0.5, quiet=True).resolved()
    rows = run(config).rows
    federation = load_federation(SMALL)
    assert rows[-2]["bytes_up"] == 5 * 4 * 2 * (12 + 1) * 6 * 4, "the projection and Δc_i go up; the classifier never"
    rounds = sampling.schedule(federation.num_clients, 4, True, config.seed, 5, past_coverage=True)
    weight, bias = plain_sphere_scaffold(federation, config, rounds)
    with np.load(out / "classifier.npz") as arrays:
        assert np.allclose(arrays["proj_weight"], weight.numpy(), rtol=1e-4, atol=1e-5)
        assert np.allclose(arrays["proj_bias"], bias.numpy(), rtol=1e-4, atol=1e-5)
    assert not np.allclose(weight.numpy(), plain_sphere_scaffold(federation, replace(config, client_lr=0.1), rounds)[0].numpy(),
                           atol=1e-3), "the comparison can tell settings apart"


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_spherefed_with_momentum_and_a_cosine_schedule_equals_plain_torch(ray_session, tmp_path):
    out = tmp_path / "sphere-momentum"
    config = RunConfig(method="scaffold", variant="II", head="sphere", sphere_dim=6, client_lr=0.2, batch_size=4, local_epochs=2,
                       client_momentum=0.9, lr_schedule="cosine", weight_decay=1e-5, clients_per_round=4, dataset=SMALL,
                       out=str(out), rounds=5, eval_every=5, num_shards=2, cpus_per_shard=0.5, quiet=True).resolved()
    rows = run(config).rows
    assert rows[-1]["client_momentum"] == 0.9 and rows[-1]["lr_schedule"] == "cosine", "the settings are config columns"
    federation = load_federation(SMALL)
    rounds = sampling.schedule(federation.num_clients, 4, True, config.seed, 5, past_coverage=True)
    # 0.2 · (1 + cos(π (t − 1) / 5)) / 2 for rounds t = 1..5
    lrs = [0.2, 0.18090169943749475, 0.13090169943749476, 0.06909830056250527, 0.019098300562505258]
    weight, bias = plain_sphere_scaffold(federation, config, rounds, lrs)
    with np.load(out / "classifier.npz") as arrays:
        assert np.allclose(arrays["proj_weight"], weight.numpy(), rtol=1e-4, atol=1e-5)
        assert np.allclose(arrays["proj_bias"], bias.numpy(), rtol=1e-4, atol=1e-5)
    assert not np.allclose(weight.numpy(), plain_sphere_scaffold(federation, config, rounds)[0].numpy(), atol=1e-3), \
        "the schedule changes the result"


def test_spherefed_options_are_checked():
    with pytest.raises(FedrayError, match="--head sphere"):
        RunConfig(method="fedavg", head="sphere", init="fed3r").validate()
    with pytest.raises(FedrayError, match="ftfeat"):
        RunConfig(method="fedavg", head="sphere", finetune="ft").validate()
    with pytest.raises(FedrayError, match="--sphere-loss"):
        RunConfig(method="fedavg", head="sphere", sphere_loss="hinge").validate()
