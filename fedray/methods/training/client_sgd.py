"""A client's local SGD by autograd, with the run's training algorithm as hooks: every path that trains runs it.

Heads on features (when the algorithm does not take the dual form of
:mod:`fedray.methods.training.local`), SphereFed's projection, fine-tuning on images
and TCT's stage 1 all train a client with :func:`train_client`:
``torch.optim.SGD`` (lr, weight decay, momentum of the round's
:class:`LocalSGD`) over the client's mini-batches, each step on the gradient
of :meth:`FederatedAlgorithm.loss` passed through
:meth:`FederatedAlgorithm.correct_gradient`, then
:meth:`FederatedAlgorithm.upload`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedray.methods.training.local import LocalSGD, client_rng, minibatches
from fedray.methods.algorithm import ClientRound, FederatedAlgorithm, Loss, Params, Upload
from fedray.methods.checks import check_loss, check_same_upload, check_tensors, check_upload


@dataclass(frozen=True)
class CrossEntropy:
    """The mean cross-entropy of output / ``temperature``: linear probing's loss, the one the dual form trains."""

    temperature: float = 1.0

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output / self.temperature, labels)

    def per_sample(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each sample's cross-entropy (what :meth:`__call__` averages)."""
        return torch.nn.functional.cross_entropy(output / self.temperature, labels, reduction="none")


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


def loss_squares(path_loss: Loss, output: torch.Tensor, labels: torch.Tensor) -> float:
    """Σ over the samples ``output`` scores of their squared loss, in float64: a loss's own ``per_sample`` losses
    where it has them, else the path's mean loss of each sample alone (a path's loss is a mean over its samples)."""
    with torch.no_grad():
        per_sample = getattr(path_loss, "per_sample", None)
        losses = per_sample(output, labels) if per_sample is not None else \
            torch.stack([path_loss(output[row:row + 1], labels[row:row + 1]) for row in range(len(labels))])
        return float((losses.double() ** 2).sum())


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


def add_upload(sums: Params | None, upload: Upload, algorithm: FederatedAlgorithm, weighted: bool = True) -> Params:
    """``sums`` + weight × the upload's tensors (a new dict, ``sums`` None the first time), which must have the names
    and shapes of the sums (``algorithm``'s uploads); ``weighted`` false: + the tensors as they are (they hold
    w_k · t_k already: :attr:`~fedray.methods.postprocessor.Postprocessing.exact`)."""
    added = {name: upload.weight * tensor if weighted else tensor for name, tensor in upload.tensors.items()}
    if sums is None:
        return added
    check_same_upload(algorithm, upload.tensors, sums)
    return {name: sums[name] + added[name] for name in sums}
