"""Batched local training equals each client trained alone with torch.optim.SGD on the same mini-batches."""

import numpy as np
import pytest
import torch

from fedray.gradient.local import LocalSGD, client_rng, minibatches, train_heads
from jobs.bench_lp import train_client_plainly


@pytest.mark.parametrize("sgd", [
    LocalSGD(),
    LocalSGD(lr=0.05, batch_size=4, epochs=3, prox_mu=0.5),
    LocalSGD(batch_size=7, epochs=2, temperature=0.1),
])
def test_batched_training_equals_training_each_client_alone(sgd):
    generator = torch.Generator().manual_seed(0)
    sizes = np.array([1, 2, 13, 60, 5, 120])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    dim, classes = 12, 9
    features = torch.randn(offsets[-1], dim, generator=generator, dtype=torch.float64)
    labels = torch.randint(classes, (offsets[-1],), generator=generator)
    weight = 0.1 * torch.randn(dim, classes, generator=generator, dtype=torch.float64)
    bias = 0.1 * torch.randn(classes, generator=generator, dtype=torch.float64)
    clients = np.array([40, 7, 3, 99, 12, 5])
    heads = train_heads(features, labels, offsets, clients, weight, bias, sgd, seed=5, round_number=17)
    weights, biases = heads.weights(), heads.bias
    expected_delta = torch.zeros_like(weight)
    for k, client in enumerate(clients):
        rows = slice(offsets[k], offsets[k + 1])
        batches = minibatches(int(sizes[k]), sgd.batch_size, sgd.epochs, client_rng(5, 17, int(client)))
        expected_w, expected_b = train_client_plainly(features[rows], labels[rows], weight, bias, sgd, batches)
        torch.testing.assert_close(weights[k], expected_w, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(biases[k], expected_b, rtol=1e-10, atol=1e-12)
        expected_delta += int(sizes[k]) * (expected_w - weight)
    delta_w, _, total = heads.weighted_update(bias)
    assert total == sizes.sum()
    torch.testing.assert_close(delta_w, expected_delta, rtol=1e-10, atol=1e-10)


def test_a_clients_minibatches_depend_only_on_seed_round_and_client():
    a = minibatches(23, 5, 2, client_rng(1, 4, 8))
    b = minibatches(23, 5, 2, client_rng(1, 4, 8))
    c = minibatches(23, 5, 2, client_rng(1, 5, 8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == 10
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert sorted(np.concatenate(a[:5])) == list(range(23)), "each epoch visits every sample once"
