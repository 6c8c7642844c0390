"""A client's local SGD by autograd, with the run's training algorithm as hooks: every path that trains runs it.

Heads on features (when the algorithm does not take the dual form of
:mod:`fedray.methods.training.local`), SphereFed's projection, fine-tuning on images
and TCT's stage 1 all train a client with :func:`train_client`:
``torch.optim.SGD`` (lr, weight decay, momentum of the round's
:class:`LocalSGD`) over the client's mini-batches, each step on the gradient
of :meth:`FederatedAlgorithm.loss` passed through
:meth:`FederatedAlgorithm.correct_gradient`, then
:meth:`FederatedAlgorithm.upload`.

:class:`ClientAlgorithm` is the older plugin interface (a client's loss and
gradient hooks beside a built-in method); :class:`WithClientAlgorithm` runs
it as the client half of the run's algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from fedray.methods.training.local import LocalSGD, client_rng, minibatches
from fedray.methods.algorithm import Aggregate, ClientRound, FederatedAlgorithm, Loss, Params, Population, Upload
from fedray.methods.checks import check_loss, check_same_upload, check_tensors, check_upload
from fedray.methods.training_algorithms import CONTROL, Scaffold


@dataclass(frozen=True)
class CrossEntropy:
    """The mean cross-entropy of output / ``temperature``: linear probing's loss, the one the dual form trains."""

    temperature: float = 1.0

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output / self.temperature, labels)


def client_batches(size: int, sgd: LocalSGD, seed: int, round_number: int, client: int) -> list[np.ndarray]:
    """A client's mini-batches in a round, the same on every path: they depend on the seed, the round and the client only."""
    return minibatches(size, sgd.batch_size, sgd.epochs, client_rng(seed, round_number, client))


def local_sgd(params: Params, forward: Callable[[np.ndarray], torch.Tensor], labels: torch.Tensor,
              batches: list[np.ndarray], sgd: LocalSGD, algorithm: FederatedAlgorithm, client: ClientRound) -> None:
    """Train one client: ``params`` (leaf tensors that require grad, named as ``client.start``) are updated in place.

    Each step runs ``forward(batch)`` (the output for the samples ``batch``,
    indices into ``labels``), the algorithm's loss, autograd and its gradient
    corrections, then ``torch.optim.SGD`` with ``sgd``'s (the round's) lr,
    weight decay and momentum (a fresh momentum buffer: a client creates its
    optimizer when the round's model arrives).
    """
    optimizer = torch.optim.SGD(list(params.values()), lr=sgd.lr, weight_decay=sgd.weight_decay, momentum=sgd.momentum)
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        check_loss(algorithm, algorithm.loss(forward(batch), labels[batch], params, client)).backward()
        for name, value in params.items():
            algorithm.correct_gradient(name, value.grad, value.detach(), client)
        optimizer.step()


def start_client(algorithm: FederatedAlgorithm, client: int, round_number: int, size: int, batches: list[np.ndarray],
                 sgd: LocalSGD, start: Params, broadcast: Params, state: Params | None, path_loss: Loss,
                 start_gradient: Params | None = None) -> ClientRound:
    """A client's round: its state (created by the algorithm at its first participation) and what it received
    (``start_gradient``: the path's, when the algorithm needs it)."""
    if state is None:
        state = check_tensors(algorithm, "init_client_state", algorithm.init_client_state(start),
                              "None or a dict of tensors by name", optional=True)
    return ClientRound(client, round_number, size, len(batches), sgd.lr, start, broadcast, state, path_loss,
                       start_gradient)


def start_loss(path_loss: Loss, output: Callable[[Params], torch.Tensor], labels: torch.Tensor, params: Params,
               gradient: bool) -> tuple[float, Params | None]:
    """The path's mean loss at ``params`` over the samples ``output(params)`` scores, and with ``gradient`` its
    gradient (one tensor per parameter; ``params`` are not changed)."""
    if not gradient:
        with torch.no_grad():
            return float(path_loss(output(params), labels)), None
    at = {name: value.detach().requires_grad_() for name, value in params.items()}
    loss = path_loss(output(at), labels)
    return float(loss.detach()), dict(zip(at, torch.autograd.grad(loss, list(at.values()))))


def train_client(
    algorithm: FederatedAlgorithm,
    client: ClientRound,
    params: Params,
    forward: Callable[[Params, np.ndarray], torch.Tensor],
    labels: torch.Tensor,
    batches: list[np.ndarray],
    sgd: LocalSGD,
    sent: Callable[[Params], Params] | None = None,
) -> tuple[Upload, Params | None]:
    """Local SGD of ``params`` (leaf tensors requiring grad, from ``client.start``), then the algorithm's upload.

    ``forward(params, batch)`` is the model's output on the samples ``batch``;
    ``sent`` maps the trained parameters to everything the client sends (a
    network's buffers too), by default the trained parameters themselves.
    """
    local_sgd(params, lambda batch: forward(params, batch), labels, batches, sgd, algorithm, client)
    trained = {name: value.detach() for name, value in params.items()}
    return check_upload(algorithm, algorithm.upload(client, trained if sent is None else sent(trained)))


def add_upload(sums: Params | None, upload: Upload, algorithm: FederatedAlgorithm) -> Params:
    """``sums`` + weight × the upload's tensors (a new dict, ``sums`` None the first time), which must have the names
    and shapes of the sums (``algorithm``'s uploads)."""
    weighted = {name: upload.weight * tensor for name, tensor in upload.tensors.items()}
    if sums is None:
        return weighted
    check_same_upload(algorithm, upload.tensors, sums)
    return {name: sums[name] + weighted[name] for name in sums}


@dataclass(frozen=True)
class ClientAlgorithm:
    """The older client-algorithm plugin: a client's loss and gradient hooks beside a built-in method.

    ``loss`` is the path's batch mean loss (:meth:`batch_loss` returns it);
    ``prox_mu`` > 0 adds FedProx's (μ/2)‖θ − θ₀‖²; with ``--method scaffold``
    every gradient also gets c − c_i. Subclass it as a frozen dataclass whose
    extra fields, with defaults, are its options (``--client-algorithm``);
    a :class:`~fedray.methods.algorithm.FederatedAlgorithm` is the interface
    for a whole algorithm (its server half and client state included).
    """

    supplied: ClassVar[tuple[str, ...]] = ("loss", "prox_mu")
    """Filled in by the engine, not options: the path's loss and, with ``--method fedprox``, its μ."""

    loss: Loss
    prox_mu: float = 0.0

    def batch_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss a step differentiates: the path's ``loss`` (override to change or add to it)."""
        return self.loss(output, labels)

    def correct(self, gradient: torch.Tensor, value: torch.Tensor, start: torch.Tensor, correction: torch.Tensor | None) -> None:
        """Add to one parameter's gradient of the batch loss, in place, μ(θ − θ₀) and then c − c_i (if any)."""
        if self.prox_mu:
            gradient.add_(self.prox_mu * (value - start))
        if correction is not None:
            gradient.add_(correction)


@dataclass(frozen=True)
class WithClientAlgorithm(FederatedAlgorithm):
    """A built-in algorithm (``base``: its server half, client state and upload) whose clients' loss and gradient are a
    :class:`ClientAlgorithm` plugin's (``hooks``, with its ``options``; ``prox_mu``: FedProx's μ)."""

    base: FederatedAlgorithm = FederatedAlgorithm()
    hooks: type[ClientAlgorithm] = ClientAlgorithm
    options: tuple[tuple[str, object], ...] = ()
    prox_mu: float = 0.0

    def _hooks(self, client: ClientRound) -> ClientAlgorithm:
        return self.hooks(loss=client.path_loss, prox_mu=self.prox_mu, **dict(self.options))

    def init_server_state(self, params: Params) -> Params:
        return self.base.init_server_state(params)

    def broadcast(self, params: Params, state: Params) -> Params:
        return self.base.broadcast(params, state)

    def server_update(self, params: Params, total: Aggregate, state: Params,
                      population: Population) -> tuple[Params, Params]:
        return self.base.server_update(params, total, state, population)

    def init_client_state(self, start: Params) -> Params | None:
        return self.base.init_client_state(start)

    @property
    def needs_start_gradient(self) -> bool:
        return self.base.needs_start_gradient

    def loss(self, output: torch.Tensor, labels: torch.Tensor, params: Params, client: ClientRound) -> torch.Tensor:
        return self._hooks(client).batch_loss(output, labels)

    def correct_gradient(self, name: str, gradient: torch.Tensor, value: torch.Tensor, client: ClientRound) -> None:
        correction = None
        if isinstance(self.base, Scaffold):
            correction = client.broadcast[CONTROL + name] - client.state[CONTROL + name]
        self._hooks(client).correct(gradient, value, client.start[name], correction)

    def upload(self, client: ClientRound, trained: Params) -> tuple[Upload, Params | None]:
        return self.base.upload(client, trained)

    @property
    def stateful(self) -> bool:
        return self.base.stateful
