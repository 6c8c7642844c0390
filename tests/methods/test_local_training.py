"""Batched local training equals each client trained alone with torch.optim.SGD on the same mini-batches."""

import numpy as np
import pytest
import torch

from fedray.methods.training.local import Control, LocalSGD, client_rng, minibatches, train_heads
from fedray.methods.training.schedule import LrSchedule
from tests.reference import client_gradient, train_client_plainly
from tests.threads import on_threads


@pytest.mark.parametrize("sgd, scaffold", [
    (LocalSGD(), False),
    (LocalSGD(lr=0.05, batch_size=4, epochs=3, prox_mu=0.5), False),
    (LocalSGD(batch_size=7, epochs=2, temperature=0.1), False),
    (LocalSGD(lr=0.05, batch_size=4, epochs=3, temperature=0.5), True),
    (LocalSGD(lr=0.05, batch_size=4, epochs=3, momentum=0.9), False),
    (LocalSGD(lr=0.05, weight_decay=1e-2, batch_size=6, epochs=2, prox_mu=0.5, momentum=0.5, temperature=0.5), False),
    (LocalSGD(lr=0.05, batch_size=4, epochs=3, temperature=0.5, momentum=0.9), True),
])
def test_batched_training_equals_training_each_client_alone(sgd, scaffold):
    generator = torch.Generator().manual_seed(0)
    sizes = np.array([1, 2, 13, 60, 5, 120])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    dim, classes = 12, 9
    features = torch.randn(offsets[-1], dim, generator=generator, dtype=torch.float64)
    labels = torch.randint(classes, (offsets[-1],), generator=generator)
    weight = 0.1 * torch.randn(dim, classes, generator=generator, dtype=torch.float64)
    bias = 0.1 * torch.randn(classes, generator=generator, dtype=torch.float64)
    clients = np.array([40, 7, 3, 99, 12, 5])
    control = None
    if scaffold:
        control = Control(0.1 * torch.randn(dim, classes, generator=generator, dtype=torch.float64),
                          0.1 * torch.randn(classes, generator=generator, dtype=torch.float64),
                          0.1 * torch.randn(offsets[-1], classes, generator=generator, dtype=torch.float64))
    heads = train_heads(features, labels, offsets, clients, weight, bias, sgd, seed=5, round_number=17, control=control)
    weights, biases = heads.weights(), heads.bias
    expected_delta = torch.zeros_like(weight)
    expected_control = torch.zeros_like(weight)
    for k, client in enumerate(clients):
        rows = slice(offsets[k], offsets[k + 1])
        batches = minibatches(int(sizes[k]), sgd.batch_size, sgd.epochs, client_rng(5, 17, int(client)))
        correction = None
        if scaffold:
            own = features[rows].T @ control.rows[rows], control.rows[rows].sum(0)
            correction = control.weight - own[0], control.bias - own[1]
            new = client_gradient(features[rows], labels[rows], weight, bias, sgd.temperature)
            torch.testing.assert_close(features[rows].T @ heads.gradient_rows[rows], new[0], rtol=1e-10, atol=1e-12)
            expected_control += int(sizes[k]) * (new[0] - own[0])
        expected_w, expected_b = train_client_plainly(features[rows], labels[rows], weight, bias, sgd, batches, correction)
        torch.testing.assert_close(weights[k], expected_w, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(biases[k], expected_b, rtol=1e-10, atol=1e-12)
        expected_delta += int(sizes[k]) * (expected_w - weight)
    delta_w, _, total = heads.weighted_update(bias)
    assert total == sizes.sum()
    torch.testing.assert_close(delta_w, expected_delta, rtol=1e-10, atol=1e-10)
    expected_loss = sum(float(torch.nn.functional.cross_entropy((features[offsets[k]:offsets[k + 1]] @ weight + bias) / sgd.temperature,
                                                                labels[offsets[k]:offsets[k + 1]], reduction="sum"))
                        for k in range(len(clients)))
    assert heads.start_loss() == pytest.approx(expected_loss, rel=1e-12)
    if scaffold:
        torch.testing.assert_close(heads.control_update()[0], expected_control, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("sgd, scaffold", [
    (LocalSGD(lr=0.05, batch_size=8, epochs=2), False),
    (LocalSGD(lr=0.05, batch_size=8, epochs=2, prox_mu=0.1, momentum=0.9), False),
    (LocalSGD(lr=0.05, batch_size=8, epochs=2, temperature=0.5), True),
])
def test_a_clients_head_and_a_parts_sums_are_the_same_bits_among_any_clients_on_any_threads(sgd, scaffold):
    """What a client trains, in float32 as the shards do, does not depend on which clients train beside it (padding,
    groups, products of many rows) or on the threads; a part's sums depend on its clients alone."""
    generator = torch.Generator().manual_seed(3)
    sizes = np.array([1, 2, 5, 13, 16, 17, 40, 64, 65, 130, 9, 300])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    dim, classes = 48, 30
    features = torch.randn(offsets[-1], dim, generator=generator)
    labels = torch.randint(classes, (offsets[-1],), generator=generator)
    weight, bias = 0.1 * torch.randn(dim, classes, generator=generator), 0.1 * torch.randn(classes, generator=generator)
    control_rows = 0.1 * torch.randn(offsets[-1], classes, generator=generator)
    control_w, control_b = 0.1 * torch.randn(dim, classes, generator=generator), 0.1 * torch.randn(classes, generator=generator)
    clients = np.arange(100, 100 + len(sizes))

    def trained(ks: list[int], threads: int):
        rows = np.concatenate([np.arange(offsets[k], offsets[k + 1]) for k in ks])
        part_offsets = np.concatenate([[0], np.cumsum(sizes[ks])])
        control = Control(control_w, control_b, control_rows[rows]) if scaffold else None
        return on_threads(threads, lambda: train_heads(features[rows], labels[rows], part_offsets, clients[ks], weight,
                                                       bias, sgd, seed=5, round_number=3, control=control,
                                                       loss_squares=True))

    everyone = trained(list(range(len(sizes))), 1)

    def client(heads, k):
        rows = slice(heads.offsets[k], heads.offsets[k + 1])
        return [heads.scale[k], heads.control_scale[k], heads.bias[k], heads.coefficients[rows],
                heads.start_losses[rows], heads.gradient_rows[rows], heads.loss_squares[k]]

    for ks in ([11, 0, 3], [3], [0], [8, 7, 1], [9, 10, 5, 2, 4, 6]):
        for threads in (1, 2):
            heads = trained(ks, threads)
            for position, k in enumerate(ks):
                assert all(torch.equal(a, b) for a, b in zip(client(heads, position), client(everyone, k))), \
                    (ks, threads, k)
    for first, end in [(0, 3), (3, 4), (4, 12)]:
        alone = trained(list(range(first, end)), 2)
        together = everyone.weighted_update(bias, slice(first, end))
        assert all(torch.equal(a, b) for a, b in zip(alone.weighted_update(bias), together))
        assert alone.start_loss() == everyone.start_loss(slice(first, end))
        if scaffold:
            assert all(torch.equal(a, b) for a, b in zip(alone.control_update(), everyone.control_update(slice(first, end))))


def test_a_clients_minibatches_depend_only_on_seed_round_and_client():
    a = minibatches(23, 5, 2, client_rng(1, 4, 8))
    b = minibatches(23, 5, 2, client_rng(1, 4, 8))
    c = minibatches(23, 5, 2, client_rng(1, 5, 8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == 10
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert sorted(np.concatenate(a[:5])) == list(range(23)), "each epoch visits every sample once"


def test_a_scheduled_round_trains_at_that_rounds_learning_rate():
    generator = torch.Generator().manual_seed(1)
    sizes = np.array([9, 30])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    features = torch.randn(offsets[-1], 5, generator=generator, dtype=torch.float64)
    labels = torch.randint(4, (offsets[-1],), generator=generator)
    weight, bias = torch.zeros(5, 4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    clients = np.array([3, 8])

    def trained(sgd: LocalSGD, round_number: int) -> torch.Tensor:
        return train_heads(features, labels, offsets, clients, weight, bias, sgd, 0, round_number).weights()

    cosine = LocalSGD(lr=0.2, batch_size=4, momentum=0.9, schedule=LrSchedule("cosine", rounds=40))
    # round 17 of 40: 0.2 · (1 + cos(π · 16/40)) / 2 = 0.2 · 0.6545084971874737
    torch.testing.assert_close(trained(cosine, 17), trained(LocalSGD(lr=0.1309016994374947, batch_size=4, momentum=0.9), 17),
                               rtol=1e-12, atol=1e-14)
    step = LocalSGD(lr=0.2, batch_size=4, schedule=LrSchedule("step", milestones=(10, 20), gamma=0.5))
    torch.testing.assert_close(trained(step, 10), trained(LocalSGD(lr=0.2, batch_size=4), 10), rtol=0, atol=0)
    torch.testing.assert_close(trained(step, 11), trained(LocalSGD(lr=0.1, batch_size=4), 11), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(trained(step, 21), trained(LocalSGD(lr=0.05, batch_size=4), 21), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("schedule, factors", [
    (LrSchedule(), {1: 1.0, 50: 1.0}),
    (LrSchedule("cosine", rounds=4), {1: 1.0, 2: 0.8535533905932737, 3: 0.5, 4: 0.14644660940672627}),
    (LrSchedule("step", milestones=(2, 3), gamma=0.1), {1: 1.0, 2: 1.0, 3: 0.1, 4: 0.010000000000000002}),
])
def test_learning_rate_schedules_follow_torchs_schedulers_stepped_once_per_round(schedule, factors):
    assert {t: schedule.factor(t) for t in factors} == factors


@pytest.mark.parametrize("sgd, scaffold", [
    (LocalSGD(lr=0.05, batch_size=4, epochs=3, prox_mu=0.5), False),
    (LocalSGD(lr=0.05, batch_size=4, epochs=3, temperature=0.5, momentum=0.9), True),
])
def test_a_step_budget_stops_a_batched_client_after_its_first_minibatches(sgd, scaffold):
    """Budgets that reorder the slots of a size group (the 120-sample client takes fewer steps than the 60-sample
    one)."""
    generator = torch.Generator().manual_seed(0)
    sizes = np.array([1, 2, 13, 60, 5, 120])
    budgets = np.array([1, 5, 7, 45, 2, 30])  # of 3, 3, 12, 45, 6 and 90 steps
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    features = torch.randn(offsets[-1], 12, generator=generator, dtype=torch.float64)
    labels = torch.randint(9, (offsets[-1],), generator=generator)
    weight = 0.1 * torch.randn(12, 9, generator=generator, dtype=torch.float64)
    bias = 0.1 * torch.randn(9, generator=generator, dtype=torch.float64)
    clients = np.array([40, 7, 3, 99, 12, 5])
    control = None
    if scaffold:
        control = Control(0.1 * torch.randn(12, 9, generator=generator, dtype=torch.float64),
                          0.1 * torch.randn(9, generator=generator, dtype=torch.float64),
                          0.1 * torch.randn(offsets[-1], 9, generator=generator, dtype=torch.float64))
    heads = train_heads(features, labels, offsets, clients, weight, bias, sgd, seed=5, round_number=17, control=control,
                        steps=budgets)
    weights = heads.weights()
    for k, client in enumerate(clients):
        rows = slice(offsets[k], offsets[k + 1])
        batches = minibatches(int(sizes[k]), sgd.batch_size, sgd.epochs, client_rng(5, 17, int(client)))[:budgets[k]]
        correction = None
        if scaffold:
            correction = (control.weight - features[rows].T @ control.rows[rows],
                          control.bias - control.rows[rows].sum(0))
        expected_w, expected_b = train_client_plainly(features[rows], labels[rows], weight, bias, sgd, batches,
                                                      correction)
        torch.testing.assert_close(weights[k], expected_w, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(heads.bias[k], expected_b, rtol=1e-10, atol=1e-12)
