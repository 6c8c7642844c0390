"""A shard's clients' squared losses, measured when asked (Oort's statistical utility is made of them): each client's
sum over its samples of the squared loss at the round's starting model, on the batched dual form, on autograd and on
SphereFed's projection, against a plain loss computed sample by sample below."""

import math
from functools import partial

import numpy as np
import pytest
import torch

from fedray.methods.base import ClientBatch
from fedray.methods.sphere import sphere_logits, sphere_loss
from fedray.methods.training.heads import train_features, train_linear_heads
from fedray.methods.training.local import LocalSGD
from fedray.methods.training_algorithms import FedAvg

SIZES = np.array([3, 1, 7, 4])
CLIENTS = np.array([11, 2, 30, 5])
DIM, CLASSES = 6, 4


class ByAutograd(FedAvg):
    """FedAvg that the dual form does not know: trained by autograd, client by client."""


class Kept:
    """The clients' states, in a dict."""

    def __init__(self):
        self.states = {}

    def get(self, client):
        return self.states.get(client)

    def put(self, client, state):
        self.states[client] = state


def batch() -> ClientBatch:
    generator = torch.Generator().manual_seed(3)
    offsets = np.concatenate([[0], np.cumsum(SIZES)])
    features = torch.randn(int(offsets[-1]), DIM, generator=generator, dtype=torch.float64)
    labels = torch.randint(CLASSES, (int(offsets[-1]),), generator=generator)
    return ClientBatch(features, labels, offsets, CLIENTS)


def head():
    generator = torch.Generator().manual_seed(4)
    return {"weight": torch.randn(DIM, CLASSES, generator=generator, dtype=torch.float64),
            "bias": torch.randn(CLASSES, generator=generator, dtype=torch.float64)}


def plain_cross_entropy_squares(batch, weight, bias, temperature):
    """Σ over each client's samples of (log Σ_c exp(z_c / T) − z_y / T)², one sample at a time."""
    squares = []
    for k in range(len(batch.clients)):
        total = 0.0
        for row in range(batch.offsets[k], batch.offsets[k + 1]):
            x = batch.features[row].tolist()
            logits = [(sum(x[i] * float(weight[i, c]) for i in range(DIM)) + float(bias[c])) / temperature
                      for c in range(CLASSES)]
            loss = math.log(sum(math.exp(z) for z in logits)) - logits[int(batch.labels[row])]
            total += loss * loss
        squares.append(total)
    return squares


@pytest.mark.parametrize("algorithm", [FedAvg(), ByAutograd()], ids=["dual-form", "autograd"])
@pytest.mark.parametrize("steps", [None, np.array([1, 1, 2, 1])], ids=["whole", "partial"])
def test_each_clients_squared_losses_are_those_of_the_starting_head_over_all_its_samples(algorithm, steps):
    sgd = LocalSGD(lr=0.1, batch_size=2, epochs=2, temperature=0.5)
    params, clients = head(), batch()
    [update] = train_linear_heads(clients, params, {}, sgd, algorithm, seed=1, round_number=3, states=Kept(),
                                steps=steps, client_losses=True)
    assert update.client_losses.clients.tolist() == CLIENTS.tolist()
    assert update.client_losses.squares.dtype == np.float64
    expected = plain_cross_entropy_squares(clients, params["weight"], params["bias"], 0.5)
    assert update.client_losses.squares.tolist() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("algorithm", [FedAvg(), ByAutograd()], ids=["dual-form", "autograd"])
def test_the_losses_are_measured_only_when_asked_and_change_nothing_else(algorithm):
    sgd = LocalSGD(lr=0.1, batch_size=2, epochs=2)
    [plain] = train_linear_heads(batch(), head(), {}, sgd, algorithm, seed=1, round_number=3, states=Kept())
    [measured] = train_linear_heads(batch(), head(), {}, sgd, algorithm, seed=1, round_number=3, states=Kept(),
                                  client_losses=True)
    assert plain.client_losses is None
    assert measured.loss_sum == plain.loss_sum and measured.weight == plain.weight
    assert all(torch.equal(measured.sums[name], plain.sums[name]) for name in plain.sums)


def test_spherefeds_mean_squared_loss_is_measured_sample_by_sample():
    """SphereFed's path loss (1/C)‖W z − onehot(y)‖², z = normalize(P x + q), has no per-sample form of its
    own."""
    generator = torch.Generator().manual_seed(5)
    width = 3
    classifier = torch.randn(CLASSES, width, generator=generator, dtype=torch.float64)
    projection = {"weight": torch.randn(width, DIM, generator=generator, dtype=torch.float64),
                  "bias": torch.randn(width, generator=generator, dtype=torch.float64)}
    clients = batch()
    [update] = train_features(clients, projection, {}, LocalSGD(lr=0.1, batch_size=2), FedAvg(), 1, 3, Kept(),
                            lambda params, x: sphere_logits(x, params["weight"], params["bias"], classifier),
                            partial(sphere_loss, loss="mse", temperature=1.0), client_losses=True)
    expected = []
    for k in range(len(CLIENTS)):
        total = 0.0
        for row in range(clients.offsets[k], clients.offsets[k + 1]):
            z = projection["weight"] @ clients.features[row] + projection["bias"]
            z = z / z.norm()
            loss = sum((float(score) - (1.0 if c == int(clients.labels[row]) else 0.0)) ** 2
                       for c, score in enumerate(classifier @ z)) / CLASSES
            total += loss * loss
        expected.append(total)
    assert update.client_losses.squares.tolist() == pytest.approx(expected, rel=1e-12)
