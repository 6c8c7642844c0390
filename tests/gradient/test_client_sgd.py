"""One autograd local SGD with the client algorithm as hooks; the dual form of linear heads agrees with it where it applies."""

from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import pytest
import torch

from fedray.gradient.client_sgd import ClientAlgorithm, CrossEntropy, local_sgd
from fedray.gradient.heads import DenseHeads, dual_form_supports, train_heads_by_autograd, train_linear_heads
from fedray.gradient.local import Control, LocalSGD, TrainedHeads, client_rng, minibatches, train_heads
from fedray.gradient.probing import LocalTrainer, as_arrays
from fedray.methods.base import ClientBatch

SIZES = np.array([1, 2, 13, 60, 5, 31])
OFFSETS = np.concatenate([[0], np.cumsum(SIZES)])
CLIENTS = np.array([40, 7, 3, 99, 12, 5])
DIM, CLASSES = 12, 9


def problem(scaffold: bool) -> tuple:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(OFFSETS[-1], DIM, generator=generator, dtype=torch.float64)
    labels = torch.randint(CLASSES, (OFFSETS[-1],), generator=generator)
    weight = 0.1 * torch.randn(DIM, CLASSES, generator=generator, dtype=torch.float64)
    bias = 0.1 * torch.randn(CLASSES, generator=generator, dtype=torch.float64)
    control = None
    if scaffold:
        control = Control(0.1 * torch.randn(DIM, CLASSES, generator=generator, dtype=torch.float64),
                          0.1 * torch.randn(CLASSES, generator=generator, dtype=torch.float64),
                          0.1 * torch.randn(OFFSETS[-1], CLASSES, generator=generator, dtype=torch.float64))
    return features, labels, weight, bias, control


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "scaffold"])
def test_the_dual_form_and_autograd_train_the_same_heads(algorithm, momentum):
    sgd = LocalSGD(lr=0.05, weight_decay=1e-2, batch_size=4, epochs=3, temperature=0.5, momentum=momentum,
                   prox_mu=0.3 if algorithm == "fedprox" else 0.0)
    features, labels, weight, bias, control = problem(algorithm == "scaffold")
    dual = train_heads(features, labels, OFFSETS, CLIENTS, weight, bias, sgd, 5, 17, control)
    dense = train_heads_by_autograd(features, labels, OFFSETS, CLIENTS, weight, bias, sgd,
                                    ClientAlgorithm(CrossEntropy(0.5), sgd.prox_mu), 5, 17, control)
    # float64 throughout: the two differ by the order of their sums only
    tolerance = {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(dense.weights(), dual.weights(), **tolerance)
    torch.testing.assert_close(dense.bias, dual.bias, **tolerance)
    assert not torch.allclose(dense.weights()[3], weight, atol=1e-3), "the heads moved"
    for ours, theirs in zip(dense.weighted_update(bias), dual.weighted_update(bias)):
        torch.testing.assert_close(ours, theirs, **tolerance)
    assert dense.start_loss == pytest.approx(dual.start_loss, rel=1e-12)
    torch.testing.assert_close(dense.gradient_rows, dual.gradient_rows, **tolerance)
    if control is not None:
        for ours, theirs in zip(dense.control_update(), dual.control_update()):
            torch.testing.assert_close(ours, theirs, **tolerance)


def test_the_dual_form_declares_the_algorithms_it_supports():
    assert dual_form_supports(ClientAlgorithm(CrossEntropy(0.1), prox_mu=0.01))
    assert dual_form_supports(LocalTrainer(LocalSGD(prox_mu=0.01, momentum=0.9), seed=0).client_algorithm())
    assert not dual_form_supports(ClientAlgorithm(partial(torch.nn.functional.cross_entropy, label_smoothing=0.1)))

    @dataclass(frozen=True)
    class Clipped(ClientAlgorithm):
        def correct(self, gradient, value, start, correction):
            super().correct(gradient, value, start, correction)
            gradient.clamp_(-1, 1)

    assert not dual_form_supports(Clipped(CrossEntropy()))
    features, labels, weight, bias, _ = problem(False)
    chosen = [type(train_linear_heads(features, labels, OFFSETS, CLIENTS, weight, bias, LocalSGD(batch_size=4), algorithm, 0, 1))
              for algorithm in (ClientAlgorithm(CrossEntropy()), Clipped(CrossEntropy()))]
    assert chosen == [TrainedHeads, DenseHeads]


@dataclass(frozen=True)
class Smoothed(ClientAlgorithm):
    """The cross-entropy with label smoothing 0.2: a client algorithm's own batch loss."""

    def batch_loss(self, output, labels):
        return torch.nn.functional.cross_entropy(output, labels, label_smoothing=0.2)


def test_a_loss_the_dual_form_does_not_support_trains_by_autograd_like_plain_torch():
    smoothed = partial(torch.nn.functional.cross_entropy, label_smoothing=0.2)
    sgd = LocalSGD(lr=0.1, weight_decay=1e-3, batch_size=5, epochs=2, momentum=0.5, prox_mu=0.25)
    features, labels, weight, bias, _ = problem(False)
    trainer = LocalTrainer(replace(sgd, client_algorithm=Smoothed), seed=3)
    update = trainer.train(ClientBatch(features, labels, OFFSETS, CLIENTS), as_arrays((weight, bias)), 4, None)

    expected_w, expected_b, expected_loss = torch.zeros_like(weight), torch.zeros_like(bias), 0.0
    for k, client in enumerate(CLIENTS):
        x, y = features[OFFSETS[k]:OFFSETS[k + 1]], labels[OFFSETS[k]:OFFSETS[k + 1]]
        expected_loss += float(smoothed(x @ weight + bias, y, reduction="sum"))
        head = torch.nn.Linear(DIM, CLASSES, dtype=torch.float64)
        with torch.no_grad():
            head.weight.copy_(weight.T)
            head.bias.copy_(bias)
        optimizer = torch.optim.SGD(head.parameters(), lr=0.1, weight_decay=1e-3, momentum=0.5)
        for batch in minibatches(len(y), 5, 2, client_rng(3, 4, int(client))):
            optimizer.zero_grad()
            prox = ((head.weight - weight.T) ** 2).sum() + ((head.bias - bias) ** 2).sum()
            (smoothed(head(x[batch]), y[batch]) + 0.25 / 2 * prox).backward()
            optimizer.step()
        expected_w += len(y) * (head.weight.detach().T - weight)
        expected_b += len(y) * (head.bias.detach() - bias)
    np.testing.assert_allclose(update.delta_weight, expected_w.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(update.delta_bias, expected_b.numpy(), rtol=1e-10, atol=1e-12)
    assert update.loss_sum == pytest.approx(expected_loss, rel=1e-12)
    assert update.weight == update.samples == SIZES.sum()


def test_one_full_batch_step_of_scaffold_option_ii_gives_the_starting_gradient_as_the_new_control():
    # θ₁ = θ₀ − η (g + c − c_i), so c_i⁺ = c_i − c + (θ₀ − θ₁) / η = g: the batch loss's gradient at θ₀
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    start = {"weight": torch.randn(4, 3, generator=generator, dtype=torch.float64),
             "bias": torch.randn(3, generator=generator, dtype=torch.float64)}
    control = {name: torch.randn(value.shape, generator=generator, dtype=torch.float64) for name, value in start.items()}
    own = {name: torch.randn(value.shape, generator=generator, dtype=torch.float64) for name, value in start.items()}
    logits = torch.nn.functional.softmax(x @ start["weight"] + start["bias"], dim=1)
    error = (logits - torch.nn.functional.one_hot(y, 3)) / 6
    params = {name: value.clone().requires_grad_() for name, value in start.items()}
    new = local_sgd(params, lambda batch: x[batch] @ params["weight"] + params["bias"], y, [np.arange(6)],
                    LocalSGD(lr=0.3, weight_decay=0.0), ClientAlgorithm(CrossEntropy()), start, control, own)
    torch.testing.assert_close(new["weight"], x.T @ error, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(new["bias"], error.sum(dim=0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(params["weight"].detach(), start["weight"] - 0.3 * (x.T @ error + control["weight"] - own["weight"]),
                               rtol=1e-12, atol=1e-14)
