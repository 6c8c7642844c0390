"""A client's local SGD by autograd, with its client algorithm as hooks: every path that trains runs it.

Heads on features (when the dual form of :mod:`fedray.gradient.local` does not
support the algorithm), SphereFed's projection, fine-tuning on images and
TCT's stage 1 all train a client with :func:`local_sgd`: ``torch.optim.SGD``
(lr, weight decay, momentum of the round's :class:`LocalSGD`) over the
client's mini-batches, each step on the gradient of the algorithm's loss plus
what :meth:`ClientAlgorithm.correct` adds (FedProx's pull, SCAFFOLD's c − c_i).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedray.gradient.backend import Params
from fedray.gradient.local import LocalSGD, client_rng, minibatches

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A batch's mean loss from the model's output and the labels."""


@dataclass(frozen=True)
class CrossEntropy:
    """The mean cross-entropy of output / ``temperature``: linear probing's loss, the one the dual form trains."""

    temperature: float = 1.0

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output / self.temperature, labels)


@dataclass(frozen=True)
class ClientAlgorithm:
    """What a client's local objective adds to plain SGD on its loss, as the hooks :func:`local_sgd` calls.

    ``loss`` is the path's batch mean loss (:meth:`batch_loss` returns it);
    ``prox_mu`` > 0 adds FedProx's (μ/2)‖θ − θ₀‖² (θ₀ the round's global
    model); with control variates every
    gradient also gets SCAFFOLD's c − c_i (Karimireddy et al.). Subclass and
    override a hook to change a client's objective (``--client-algorithm``,
    see ``examples/proximal_client.py``): a subclass is a frozen dataclass whose
    extra fields, with defaults, are its options, while ``loss`` and
    ``prox_mu`` come from the run. A subclass trains by autograd (the dual form
    supports this class only, see :func:`fedray.gradient.heads.dual_form_supports`).
    """

    loss: Loss
    prox_mu: float = 0.0

    def batch_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss a step differentiates: the path's ``loss`` (override to change or add to it)."""
        return self.loss(output, labels)

    def corrections(self, control: Params, own: Params | None) -> Params:
        """SCAFFOLD's c − c_i per parameter (c_i is zero before the client's first participation: ``own`` None)."""
        return {name: value if own is None else value - own[name] for name, value in control.items()}

    def correct(self, gradient: torch.Tensor, value: torch.Tensor, start: torch.Tensor, correction: torch.Tensor | None) -> None:
        """Add to one parameter's gradient of the batch loss, in place, μ(θ − θ₀) and then c − c_i (if any).

        μ(θ − θ₀) is rounded before it is added, as autograd adds the
        gradient of a (μ/2)‖θ − θ₀‖² term written into the loss.
        """
        if self.prox_mu:
            gradient.add_(self.prox_mu * (value - start))
        if correction is not None:
            gradient.add_(correction)

    def new_control(self, start: Params, trained: Params, control: Params, own: Params | None, step_length: float) -> Params:
        """SCAFFOLD option II: c_i⁺ = c_i − c + (θ₀ − θ) / (K η), ``step_length`` = K η (local steps × the round's lr)."""
        scale = 1.0 / step_length
        return {name: (0 if own is None else own[name]) - control[name] + scale * (start[name] - trained[name]) for name in trained}


def client_algorithm(sgd: LocalSGD, loss: Loss) -> ClientAlgorithm:
    """The clients' algorithm on a path's ``loss``: ``sgd``'s plugin with its options, else the built-in hooks, at ``sgd``'s μ."""
    return (sgd.client_algorithm or ClientAlgorithm)(loss=loss, prox_mu=sgd.prox_mu, **dict(sgd.client_options))


def client_batches(size: int, sgd: LocalSGD, seed: int, round_number: int, client: int) -> list[np.ndarray]:
    """A client's mini-batches in a round, the same on every path: they depend on the seed, the round and the client only."""
    return minibatches(size, sgd.batch_size, sgd.epochs, client_rng(seed, round_number, client))


def local_sgd(
    params: Params,
    forward: Callable[[np.ndarray], torch.Tensor],
    labels: torch.Tensor,
    batches: list[np.ndarray],
    sgd: LocalSGD,
    algorithm: ClientAlgorithm,
    start: Params,
    control: Params | None = None,
    own: Params | None = None,
) -> Params | None:
    """Train one client: ``params`` (leaf tensors that require grad, named as ``start``) are updated in place.

    Each step runs ``forward(batch)`` (the output for the samples ``batch``,
    indices into ``labels``), the algorithm's loss, autograd and its
    corrections, then ``torch.optim.SGD`` with ``sgd``'s (the round's) lr,
    weight decay and momentum (a fresh momentum buffer: a client creates its
    optimizer when the round's model arrives). With SCAFFOLD's server
    ``control`` (and the client's own c_i, ``own``, None before its first
    participation) every gradient gets c − c_i and the client's new c_i⁺
    (option II, detached) is returned; None otherwise.
    """
    optimizer = torch.optim.SGD(list(params.values()), lr=sgd.lr, weight_decay=sgd.weight_decay, momentum=sgd.momentum)
    corrections = None if control is None else algorithm.corrections(control, own)
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        algorithm.batch_loss(forward(batch), labels[batch]).backward()
        for name, value in params.items():
            algorithm.correct(value.grad, value.detach(), start[name], None if corrections is None else corrections[name])
        optimizer.step()
    if control is None:
        return None
    trained = {name: value.detach() for name, value in params.items()}
    return algorithm.new_control(start, trained, control, own, len(batches) * sgd.lr)
