"""One autograd local SGD with the training algorithm as hooks; the dual form of linear heads agrees with it where it applies."""

from dataclasses import dataclass
from functools import partial

import numpy as np
import pytest
import torch

from fedray.methods.training.client_sgd import CrossEntropy, start_client, train_client
from fedray.methods.training.heads import ROWS, train_linear_heads
from fedray.methods.training.local import LocalSGD, client_rng, minibatches
from fedray.runtime.probing import LocalTrainer
from fedray.methods.algorithm import FederatedAlgorithm
from fedray.methods.training.dual_form import DualForm, dual_form
from fedray.methods.base import ClientBatch
from fedray.methods.training_algorithms import CONTROL, FedAvg, FedProx, Scaffold, algorithm_class

SIZES = np.array([1, 2, 13, 60, 5, 31])
OFFSETS = np.concatenate([[0], np.cumsum(SIZES)])
CLIENTS = np.array([40, 7, 3, 99, 12, 5])
DIM, CLASSES = 12, 9


class DictStates(dict):
    """The clients' states as a shard keeps them: get a client's, put its next one."""

    def put(self, client, state):
        if state is not None:
            self[client] = state


def problem() -> tuple:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(OFFSETS[-1], DIM, generator=generator, dtype=torch.float64)
    labels = torch.randint(CLASSES, (OFFSETS[-1],), generator=generator)
    weight = 0.1 * torch.randn(DIM, CLASSES, generator=generator, dtype=torch.float64)
    bias = 0.1 * torch.randn(CLASSES, generator=generator, dtype=torch.float64)
    control = {CONTROL + "weight": 0.1 * torch.randn(DIM, CLASSES, generator=generator, dtype=torch.float64),
               CONTROL + "bias": 0.1 * torch.randn(CLASSES, generator=generator, dtype=torch.float64)}
    rows = 0.1 * torch.randn(OFFSETS[-1], CLASSES, generator=generator, dtype=torch.float64)
    return ClientBatch(features, labels, OFFSETS, CLIENTS), {"weight": weight, "bias": bias}, control, rows


@dataclass(frozen=True)
class ProxByAutograd(FedProx):
    """FedProx as a plugin's subclass: the same client half, trained by autograd (the dual form takes built-ins only)."""


@dataclass(frozen=True)
class ScaffoldByAutograd(Scaffold):
    """SCAFFOLD as a plugin's subclass, trained by autograd."""


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "scaffold"])
def test_the_dual_form_and_autograd_train_the_same_heads(algorithm, momentum):
    sgd = LocalSGD(lr=0.05, weight_decay=1e-2, batch_size=4, epochs=3, temperature=0.5, momentum=momentum)
    batch, params, control, rows = problem()
    dual_algorithm, autograd_algorithm = {
        "fedavg": (FedAvg(), ProxByAutograd(prox_mu=0.0)),
        "fedprox": (FedProx(prox_mu=0.3), ProxByAutograd(prox_mu=0.3)),
        "scaffold": (Scaffold(), ScaffoldByAutograd()),
    }[algorithm]
    broadcast = control if algorithm == "scaffold" else {}
    # The same c_i on both paths: the dual form keeps the gradient rows G (c_i = X_iᵀG_i), autograd c_i itself.
    dual_states, autograd_states = DictStates(), DictStates()
    if algorithm == "scaffold":
        for k, client in enumerate(CLIENTS.tolist()):
            own = rows[OFFSETS[k]:OFFSETS[k + 1]]
            dual_states[client] = {ROWS: own}
            x = batch.features[OFFSETS[k]:OFFSETS[k + 1]]
            autograd_states[client] = {CONTROL + "weight": x.T @ own, CONTROL + "bias": own.sum(dim=0)}
    [dual] = train_linear_heads(batch, params, broadcast, sgd, dual_algorithm, 5, 17, dual_states)
    [dense] = train_linear_heads(batch, params, broadcast, sgd, autograd_algorithm, 5, 17, autograd_states)
    # float64 throughout: the two differ by the order of their sums only
    tolerance = {"rtol": 1e-10, "atol": 1e-12}
    for name in ("weight", "bias"):
        torch.testing.assert_close(dense.sums[name], dual.sums[name], **tolerance)
    assert dense.sums["weight"].abs().max() > 1e-3, "the heads moved"
    assert (dense.weight, dense.samples, dense.clients) == (dual.weight, dual.samples, dual.clients) == (112.0, 112, 6)
    assert dense.loss_sum == pytest.approx(dual.loss_sum, rel=1e-12)


def test_the_dual_form_is_taken_by_the_built_ins_whose_client_half_it_knows_and_by_nothing_else():
    assert dual_form(FedAvg()) == DualForm()
    for alias in ("fedavgm", "fedadam", "fedadagrad", "fedyogi"):  # FedAvg with another server optimizer
        assert dual_form(algorithm_class(alias)()) == DualForm()
    assert dual_form(FedProx(prox_mu=0.3)) == DualForm(prox_mu=0.3)
    assert dual_form(Scaffold()) == DualForm(control=True)

    @dataclass(frozen=True)
    class Clipped(FederatedAlgorithm):
        def correct_gradient(self, name, gradient, value, client):
            gradient.clamp_(-1, 1)

    assert dual_form(Clipped()) is None
    assert dual_form(FederatedAlgorithm()) is None    # FedAvg's client half, but not the built-in: autograd
    assert dual_form(ScaffoldByAutograd()) is None    # a subclass may change any hook
    assert dual_form(SmoothedProximal()) is None      # its own loss
    assert not FedAvg().stateful and Scaffold().stateful


@dataclass(frozen=True)
class SmoothedProximal(FedProx):
    """The cross-entropy with label smoothing 0.2 and FedProx's proximal term: a plugin algorithm's own batch loss
    beside a built-in's gradient correction."""

    def loss(self, output, labels, params, client):
        return torch.nn.functional.cross_entropy(output, labels, label_smoothing=0.2)


def test_a_plugin_algorithms_own_loss_trains_by_autograd_like_plain_torch():
    smoothed = partial(torch.nn.functional.cross_entropy, label_smoothing=0.2)
    sgd = LocalSGD(lr=0.1, weight_decay=1e-3, batch_size=5, epochs=2, momentum=0.5)
    batch, params, _, _ = problem()
    weight, bias = params["weight"], params["bias"]
    trainer = LocalTrainer(sgd, 3, SmoothedProximal(prox_mu=0.25))
    [update] = trainer.train(batch, {"params": params, "broadcast": {}}, 4, DictStates())

    expected_w, expected_b, expected_loss = torch.zeros_like(weight), torch.zeros_like(bias), 0.0
    for k, client in enumerate(CLIENTS):
        x, y = batch.features[OFFSETS[k]:OFFSETS[k + 1]], batch.labels[OFFSETS[k]:OFFSETS[k + 1]]
        expected_loss += float(torch.nn.functional.cross_entropy(x @ weight + bias, y, reduction="sum"))
        head = torch.nn.Linear(DIM, CLASSES, dtype=torch.float64)
        with torch.no_grad():
            head.weight.copy_(weight.T)
            head.bias.copy_(bias)
        optimizer = torch.optim.SGD(head.parameters(), lr=0.1, weight_decay=1e-3, momentum=0.5)
        for step in minibatches(len(y), 5, 2, client_rng(3, 4, int(client))):
            optimizer.zero_grad()
            prox = ((head.weight - weight.T) ** 2).sum() + ((head.bias - bias) ** 2).sum()
            (smoothed(head(x[step]), y[step]) + 0.25 / 2 * prox).backward()
            optimizer.step()
        expected_w += len(y) * (head.weight.detach().T - weight)
        expected_b += len(y) * (head.bias.detach() - bias)
    torch.testing.assert_close(update.sums["weight"], expected_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(update.sums["bias"], expected_b, rtol=1e-10, atol=1e-12)
    # the train_loss column is the path's loss of the model received (the plain cross-entropy), whatever trains
    assert update.loss_sum == pytest.approx(expected_loss, rel=1e-12)
    assert update.weight == update.samples == SIZES.sum()


def test_one_full_batch_step_of_scaffold_option_ii_gives_the_starting_gradient_as_the_new_control():
    # θ₁ = θ₀ − η (g + c − c_i), so c_i⁺ = c_i − c + (θ₀ − θ₁) / η = g: the batch loss's gradient at θ₀
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    start = {"weight": torch.randn(4, 3, generator=generator, dtype=torch.float64),
             "bias": torch.randn(3, generator=generator, dtype=torch.float64)}
    control = {CONTROL + name: torch.randn(value.shape, generator=generator, dtype=torch.float64) for name, value in start.items()}
    own = {CONTROL + name: torch.randn(value.shape, generator=generator, dtype=torch.float64) for name, value in start.items()}
    logits = torch.nn.functional.softmax(x @ start["weight"] + start["bias"], dim=1)
    error = (logits - torch.nn.functional.one_hot(y, 3)) / 6
    params = {name: value.clone().requires_grad_() for name, value in start.items()}
    sgd, batches = LocalSGD(lr=0.3, weight_decay=0.0), [np.arange(6)]
    client = start_client(Scaffold(variant="II"), 7, 1, 6, batches, sgd, start, control, own, CrossEntropy())
    upload, new = train_client(Scaffold(variant="II"), client, params, lambda p, batch: x[batch] @ p["weight"] + p["bias"],
                               y, batches, sgd)
    torch.testing.assert_close(new[CONTROL + "weight"], x.T @ error, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(new[CONTROL + "bias"], error.sum(dim=0), rtol=1e-12, atol=1e-12)
    moved = start["weight"] - 0.3 * (x.T @ error + control[CONTROL + "weight"] - own[CONTROL + "weight"])
    torch.testing.assert_close(params["weight"].detach(), moved, rtol=1e-12, atol=1e-14)
    # it uploads its update and the change of its control variate, weighted by its samples
    assert upload.weight == 6
    torch.testing.assert_close(upload.tensors[CONTROL + "weight"], x.T @ error - own[CONTROL + "weight"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(upload.tensors["weight"], moved - start["weight"], rtol=1e-12, atol=1e-14)


def test_scaffold_option_i_is_the_same_algorithm_in_the_dual_form_and_by_autograd_round_after_round():
    """Three rounds of the same clients, each path keeping its own client states (the dual form: the gradient rows G,
    c_i = X_iᵀ G_i; autograd: c_i itself): the same model and control sums, and the same c_i, to float64 round-off."""
    sgd = LocalSGD(lr=0.05, weight_decay=1e-2, batch_size=4, epochs=2, temperature=0.5, momentum=0.9)
    batch, params, control, _ = problem()
    dual_states, autograd_states = DictStates(), DictStates()
    for round_number in (1, 2, 3):
        [dual] = train_linear_heads(batch, params, control, sgd, Scaffold(), 5, round_number, dual_states)
        [dense] = train_linear_heads(batch, params, control, sgd, ScaffoldByAutograd(), 5, round_number, autograd_states)
        for name in ("weight", "bias", CONTROL + "weight", CONTROL + "bias"):
            torch.testing.assert_close(dense.sums[name], dual.sums[name], rtol=1e-10, atol=1e-12)
        for k, client in enumerate(CLIENTS.tolist()):
            rows = dual_states[client][ROWS]
            x = batch.features[OFFSETS[k]:OFFSETS[k + 1]]
            torch.testing.assert_close(autograd_states[client][CONTROL + "weight"], x.T @ rows, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(autograd_states[client][CONTROL + "bias"], rows.sum(dim=0), rtol=1e-10, atol=1e-12)
        # the server's next c and model, as SCAFFOLD's server half computes them from either path's sums
        control = {key: value + dual.sums[key] / float(SIZES.sum()) for key, value in control.items()}
        params = {name: params[name] + dual.sums[name] / dual.weight for name in params}
    assert dense.sums[CONTROL + "weight"].abs().max() > 1e-3, "the control variates moved"


def test_scaffold_option_i_by_autograd_keeps_the_gradient_at_the_model_received_whatever_the_steps():
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(9, 4, generator=generator, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 2, 2, 0])
    start = {"weight": torch.randn(4, 3, generator=generator, dtype=torch.float64),
             "bias": torch.randn(3, generator=generator, dtype=torch.float64)}
    zero = {CONTROL + name: torch.zeros_like(value) for name, value in start.items()}
    sgd = LocalSGD(lr=0.3, weight_decay=0.1, batch_size=4, epochs=3, momentum=0.5)   # 9 steps on mini-batches
    gradient = (torch.softmax(x @ start["weight"] + start["bias"], dim=1) - torch.nn.functional.one_hot(y, 3)) / 9
    trainer = LocalTrainer(sgd, 0, ScaffoldByAutograd())
    batch = ClientBatch(x, y, np.array([0, 9]), np.array([7]))
    states = DictStates()
    trainer.train(batch, {"params": start, "broadcast": zero}, 1, states)
    torch.testing.assert_close(states[7][CONTROL + "weight"], x.T @ gradient, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(states[7][CONTROL + "bias"], gradient.sum(dim=0), rtol=1e-12, atol=1e-14)


def test_scaffolds_variant_is_i_or_ii_and_only_option_i_takes_the_dual_form():
    from fedray.core.errors import FedrayError
    from fedray.core.options import build

    assert Scaffold().variant == "I" and Scaffold().needs_start_gradient and not Scaffold(variant="II").needs_start_gradient
    assert dual_form(Scaffold(variant="II")) is None
    with pytest.raises(FedrayError, match=r"^--method scaffold: option variant must be I or II \(Karimireddy et al.'s "
                                          r"options\), got 'III'$"):
        build(Scaffold, {"variant": "III"}, "--method scaffold")
