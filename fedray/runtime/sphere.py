"""SphereFed on cached features: a trainable projection onto the sphere before the fixed classifier.

The model is z = normalize(P x + q), logits = W z with W the fixed classifier
(C × l, :func:`~fedray.methods.sphere.fixed_classifier`); only (P, q)
are trained and travel. The loss is SphereFed's MSE (1/C)‖W z − onehot(y)‖²,
or cross-entropy of W z / T for the ablation. Clients train one after another
with :func:`~fedray.methods.training.heads.train_features` on the same mini-batches
as linear probing; the shards' sums go through the same tree reduction, and the
clients' states (SCAFFOLD's c_i, ...) stay in the shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from fedray.core.accounting import PaperCosts
from fedray.methods.training.backend import RoundUpdate
from fedray.methods.training.heads import Parts, States, train_features
from fedray.methods.training.local import LocalSGD, random_head
from fedray.runtime.probing import LocalTrainer, ProbeBackend
from fedray.methods.algorithm import FederatedAlgorithm, Params
from fedray.methods.base import ClientBatch, Classifier
from fedray.methods.postprocessor import Postprocessing
from fedray.runtime.evaluator import Evaluator
from fedray.runtime.client_states import Layout, meta_layout
from fedray.runtime.shards import ShardPool
from fedray.methods.sphere import SphereHead, fixed_classifier, sphere_logits, sphere_loss

@dataclass(frozen=True)
class SphereTrainer(LocalTrainer):
    """Local training of the projection (P, q) of every sampled client of a shard, by autograd, one after another."""

    classifier: torch.Tensor | None = None
    loss: str = "mse"

    def state_layout(self, shapes: Layout) -> Layout | None:
        """Trained by autograd: what the algorithm's ``init_client_state`` makes for the projection."""
        return meta_layout(self.algorithm, shapes)

    def train(self, batch: ClientBatch, received: dict[str, Params], round_number: int, states: States,
              steps: np.ndarray | None = None, parts: Parts | None = None) -> list[RoundUpdate | None]:
        path_loss = partial(sphere_loss, loss=self.loss, temperature=self.sgd.temperature)
        forward = partial(_sphere_forward, classifier=self.classifier)
        return train_features(batch, received["params"], received["broadcast"], self.sgd, self.algorithm, self.seed,
                              round_number, states, forward, path_loss, self.postprocessing, steps, self.client_losses, parts)


def _sphere_forward(params: Params, features: torch.Tensor, classifier: torch.Tensor) -> torch.Tensor:
    return sphere_logits(features, params["weight"], params["bias"], classifier)


@dataclass(frozen=True)
class SphereMap:
    """The test-time feature map z = normalize(P x + q), for :class:`Evaluator`."""

    weight: torch.Tensor
    bias: torch.Tensor

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(features @ self.weight.T + self.bias, dim=1)


def initial_projection(dim: int, sphere_dim: int, seed: int) -> Params:
    """The projection d → l (weight l × d, bias l), initialized like every random head of a run (:func:`random_head`,
    transposed)."""
    projection = random_head(dim, sphere_dim, seed)
    return {"weight": projection["weight"].T.contiguous(), "bias": projection["bias"]}


class SphereBackend(ProbeBackend):
    """SphereFed's training on the features of a :class:`ShardPool`; the fixed classifier never travels."""

    def __init__(self, pool: ShardPool, sgd: LocalSGD, seed: int, evaluator: Evaluator, algorithm: FederatedAlgorithm,
                 head: SphereHead, postprocessing: Postprocessing = Postprocessing(),
                 client_losses: bool = False) -> None:
        self.sphere_dim = head.width(pool.federation.dim)
        self.classifier = fixed_classifier(pool.federation.num_classes, self.sphere_dim, seed).to(torch.float32)
        super().__init__(pool, sgd, seed, evaluator, algorithm, trainer=SphereTrainer(
            sgd, seed, algorithm, postprocessing, client_losses, classifier=self.classifier, loss=head.sphere_loss))

    def initial_params(self, seed: int) -> Params:
        return initial_projection(self.dim, self.sphere_dim, seed)

    def head(self, params: Params) -> Classifier:
        """The fixed classifier (l × C), on normalize(P x + q): training moves the projection (P, q) under it."""
        return Classifier(self.classifier.T.clone())

    def calibration_map(self, params: Params) -> tuple[torch.Tensor, torch.Tensor]:
        return params["weight"], params["bias"]

    def sphere_arrays(self, params: Params) -> dict[str, np.ndarray]:
        return {"proj_weight": params["weight"].numpy(), "proj_bias": params["bias"].numpy(),
                "fixed_classifier": self.classifier.numpy()}

    def accuracy(self, params: Params) -> float:
        return self.evaluator.accuracy(SphereMap(params["weight"], params["bias"]), Classifier(self.classifier.T.contiguous()))

    def model_floats(self) -> int:
        """The projection; the classifier is fixed and known to every client."""
        return (self.dim + 1) * self.sphere_dim

    def paper_costs(self, sizes: np.ndarray) -> PaperCosts:
        """Undefined: none of the papers whose conventions fedray reproduces counts SphereFed's training."""
        return PaperCosts()

    def client_flops(self, sizes: np.ndarray) -> np.ndarray:
        """Forward and backward of the projection and the fixed classifier, every local epoch."""
        return 6.0 * self.sgd.epochs * sizes * self.sphere_dim * (self.dim + self.num_classes)
