"""SphereFed on cached features: a trainable projection onto the sphere before the fixed classifier.

The model is z = normalize(P x + q), logits = W z with W the fixed classifier
(C × l, :func:`~fedray.spherefed.classifier.fixed_classifier`); only (P, q)
are trained and travel. The loss is SphereFed's MSE (1/C)‖W z − onehot(y)‖²,
or cross-entropy of W z / T for the ablation. Clients train one after another
with ``torch.optim.SGD`` on the same mini-batches as linear probing; the
shards' sums go through the same tree reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedray.evaluation import Evaluator
from fedray.gradient.backend import Params
from fedray.gradient.local import LocalSGD, client_rng, minibatches, random_head
from fedray.gradient.probing import LocalTrainer, ProbeBackend, ShardUpdate, as_tensors
from fedray.methods.base import ClientBatch, Classifier
from fedray.runtime.shards import ShardPool
from fedray.spherefed.classifier import fixed_classifier

LOSSES = ("mse", "ce")


def sphere_logits(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, classifier: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(features @ weight.T + bias, dim=1) @ classifier.T


def sphere_loss(logits: torch.Tensor, labels: torch.Tensor, loss: str, temperature: float) -> torch.Tensor:
    """Mean over the batch of SphereFed's (1/C)‖Wz − onehot(y)‖², or of the cross-entropy of Wz / T."""
    if loss == "ce":
        return torch.nn.functional.cross_entropy(logits / temperature, labels)
    one_hot = torch.nn.functional.one_hot(labels, logits.shape[1]).to(logits.dtype)
    return ((logits - one_hot) ** 2).mean(dim=1).mean()


@dataclass(frozen=True)
class SphereTrainer(LocalTrainer):
    """Local training of the projection (P, q) of every sampled client of a shard."""

    classifier: torch.Tensor | None = None
    loss: str = "mse"

    def train(self, batch: ClientBatch, head: tuple, round_number: int, control_rows: None) -> ShardUpdate:
        weight, bias = as_tensors(head)
        delta_w, delta_b = torch.zeros_like(weight), torch.zeros_like(bias)
        loss_sum, total = 0.0, 0
        for k, client in enumerate(batch.clients):
            rows = slice(batch.offsets[k], batch.offsets[k + 1])
            x, y = batch.features[rows], batch.labels[rows]
            trained_w, trained_b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
            with torch.no_grad():
                loss_sum += len(y) * float(sphere_loss(sphere_logits(x, weight, bias, self.classifier), y, self.loss, self.sgd.temperature))
            optimizer = torch.optim.SGD([trained_w, trained_b], lr=self.sgd.lr, weight_decay=self.sgd.weight_decay)
            for step in minibatches(len(y), self.sgd.batch_size, self.sgd.epochs, client_rng(self.seed, round_number, int(client))):
                optimizer.zero_grad()
                value = sphere_loss(sphere_logits(x[step], trained_w, trained_b, self.classifier), y[step], self.loss, self.sgd.temperature)
                if self.sgd.prox_mu:
                    value = value + self.sgd.prox_mu / 2 * (((trained_w - weight) ** 2).sum() + ((trained_b - bias) ** 2).sum())
                value.backward()
                optimizer.step()
            delta_w += len(y) * (trained_w.detach() - weight)
            delta_b += len(y) * (trained_b.detach() - bias)
            total += len(y)
        return ShardUpdate(delta_w.numpy(), delta_b.numpy(), float(total), loss_sum, total)


@dataclass(frozen=True)
class SphereMap:
    """The test-time feature map z = normalize(P x + q), for :class:`Evaluator`."""

    weight: torch.Tensor
    bias: torch.Tensor

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(features @ self.weight.T + self.bias, dim=1)


class SphereBackend(ProbeBackend):
    """SphereFed's training on the features of a :class:`ShardPool`; the fixed classifier never travels."""

    def __init__(self, pool: ShardPool, sgd: LocalSGD, seed: int, evaluator: Evaluator, sphere_dim: int, loss: str) -> None:
        self.sphere_dim = sphere_dim
        self.classifier = fixed_classifier(pool.federation.num_classes, sphere_dim, seed).to(torch.float32)
        super().__init__(pool, sgd, seed, evaluator, trainer=SphereTrainer(sgd, seed, self.classifier, loss))

    def initial_params(self, seed: int) -> Params:
        """The projection d → l, initialized like every random head of a run (:func:`random_head`, transposed)."""
        projection = random_head(self.dim, self.sphere_dim, seed)
        return {"weight": projection["weight"].T.contiguous(), "bias": projection["bias"]}

    def accuracy(self, params: Params) -> float:
        return self.evaluator.accuracy(SphereMap(params["weight"], params["bias"]), Classifier(self.classifier.T.contiguous()))

    def traffic_floats(self) -> tuple[int, int]:
        """The projection down and its update up; the classifier is fixed and known to every client."""
        floats = (self.dim + 1) * self.sphere_dim
        return floats, floats

    def client_flops(self, sizes: np.ndarray) -> np.ndarray:
        """Forward and backward of the projection and the fixed classifier, every local epoch."""
        return 6.0 * self.sgd.epochs * sizes * self.sphere_dim * (self.dim + self.num_classes)
