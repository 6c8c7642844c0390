"""Linear heads on features: the dual form when it supports the client algorithm, autograd otherwise.

The dual form (:func:`~fedray.gradient.local.train_heads`) trains many
clients' heads at once but only for the built-in objective: cross-entropy at
a temperature, FedProx's pull and SCAFFOLD's correction
(:func:`dual_form_supports`). Any other :class:`ClientAlgorithm` (another
loss, an overridden hook) trains each client by autograd with
:func:`~fedray.gradient.client_sgd.local_sgd`, with the same mini-batches and
the same result interface, so the shards and the driver do not see which
path ran. SCAFFOLD's control variates are option I on both paths (the rows
G of :class:`~fedray.gradient.local.Control`: c_i⁺ is the gradient of the
client's loss at the round's starting head).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from fedray.gradient.client_sgd import ClientAlgorithm, CrossEntropy, client_batches, local_sgd
from fedray.gradient.local import Control, LocalSGD, TrainedHeads, control_change, train_heads


def dual_form_supports(algorithm: ClientAlgorithm) -> bool:
    """Whether the dual form trains ``algorithm``: the built-in hooks (FedAvg, FedProx, SCAFFOLD) on :class:`CrossEntropy`.

    Weight decay, momentum and the learning-rate schedule are the optimizer's
    and supported whatever they are.
    """
    return type(algorithm) is ClientAlgorithm and type(algorithm.loss) is CrossEntropy


@dataclass
class DenseHeads:
    """Every client's trained head by autograd, with :class:`~fedray.gradient.local.TrainedHeads`' interface.

    ``heads`` (clients, d, C) and ``bias`` (clients, C) in the order the
    clients were given; the other fields as in ``TrainedHeads``.
    """

    weight: torch.Tensor
    heads: torch.Tensor
    bias: torch.Tensor
    features: torch.Tensor
    offsets: np.ndarray
    start_loss: float
    gradient_rows: torch.Tensor
    control: Control | None

    def _sizes(self) -> torch.Tensor:
        return torch.from_numpy(np.diff(self.offsets)).to(self.weight.dtype)

    def weights(self) -> torch.Tensor:
        return self.heads

    def weighted_update(self, global_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Σ n_k (W_k − W₀), Σ n_k (c_k − b₀), Σ n_k), as ``TrainedHeads.weighted_update``."""
        n = self._sizes()
        delta_w = torch.einsum("k,kdc->dc", n, self.heads - self.weight)
        return delta_w, (n[:, None] * (self.bias - global_bias)).sum(dim=0), n.sum()

    def control_update(self) -> tuple[torch.Tensor, torch.Tensor]:
        sizes = self._sizes()
        return control_change(self.features, torch.repeat_interleave(sizes, sizes.long())[:, None], self.gradient_rows,
                              self.control.rows)


def train_heads_by_autograd(
    features: torch.Tensor, labels: torch.Tensor, offsets: np.ndarray, clients: np.ndarray, weight: torch.Tensor,
    bias: torch.Tensor, sgd: LocalSGD, algorithm: ClientAlgorithm, seed: int, round_number: int, control: Control | None = None,
) -> DenseHeads:
    """Train each client's head (x ↦ x W + b) from (``weight``, ``bias``) alone with :func:`local_sgd`; arguments as :func:`train_heads`."""
    sgd = sgd.for_round(round_number)
    start = {"weight": weight, "bias": bias}
    server = None if control is None else {"weight": control.weight, "bias": control.bias}
    heads, biases, start_loss = [], [], 0.0
    gradient_rows = torch.zeros(len(labels), weight.shape[1], dtype=weight.dtype)
    for k, client in enumerate(clients.tolist()):
        rows = slice(offsets[k], offsets[k + 1])
        x, y = features[rows], labels[rows]
        logits = torch.addmm(bias, x, weight).requires_grad_()
        loss = algorithm.batch_loss(logits, y)
        loss.backward()
        start_loss += len(y) * float(loss.detach())
        gradient_rows[rows] = logits.grad
        own = None if control is None else {"weight": x.T @ control.rows[rows], "bias": control.rows[rows].sum(dim=0)}
        trained = {name: value.clone().requires_grad_() for name, value in start.items()}
        # local_sgd's option-II c_i⁺ is not used: on features c_i⁺ is the gradient at the start (the rows above)
        local_sgd(trained, lambda batch: torch.addmm(trained["bias"], x[batch], trained["weight"]), y,
                  client_batches(len(y), sgd, seed, round_number, client), sgd, algorithm, start, server, own)
        heads.append(trained["weight"].detach())
        biases.append(trained["bias"].detach())
    return DenseHeads(weight, torch.stack(heads), torch.stack(biases), features, offsets, start_loss, gradient_rows, control)


def train_linear_heads(
    features: torch.Tensor, labels: torch.Tensor, offsets: np.ndarray, clients: np.ndarray, weight: torch.Tensor,
    bias: torch.Tensor, sgd: LocalSGD, algorithm: ClientAlgorithm, seed: int, round_number: int, control: Control | None = None,
) -> TrainedHeads | DenseHeads:
    """Every client's head, by the dual form when it supports ``algorithm`` (its loss's temperature and μ replace ``sgd``'s)."""
    if dual_form_supports(algorithm):
        sgd = replace(sgd, prox_mu=algorithm.prox_mu, temperature=algorithm.loss.temperature)
        return train_heads(features, labels, offsets, clients, weight, bias, sgd, seed, round_number, control)
    return train_heads_by_autograd(features, labels, offsets, clients, weight, bias, sgd, algorithm, seed, round_number, control)
