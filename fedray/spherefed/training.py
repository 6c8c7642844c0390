"""SphereFed on cached features: a trainable projection onto the sphere before the fixed classifier.

The model is z = normalize(P x + q), logits = W z with W the fixed classifier
(C × l, :func:`~fedray.spherefed.classifier.fixed_classifier`); only (P, q)
are trained and travel. The loss is SphereFed's MSE (1/C)‖W z − onehot(y)‖²,
or cross-entropy of W z / T for the ablation. Clients train one after another
with :func:`~fedray.gradient.client_sgd.local_sgd` on the same mini-batches
as linear probing; the shards' sums go through the same tree reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import ray
import torch

from fedray.accounting import PaperCosts
from fedray.runtime.evaluator import Evaluator
from fedray.gradient.backend import Params, RoundUpdate
from fedray.gradient.client_sgd import ClientAlgorithm, client_algorithm, client_batches, local_sgd
from fedray.gradient.control_variates import ControlVariates
from fedray.gradient.local import LocalSGD, random_head
from fedray.gradient.probing import LocalTrainer, ProbeBackend, ShardUpdate, as_arrays, as_tensors
from fedray.methods.base import ClientBatch, Classifier
from fedray.runtime.shards import ShardPool
from fedray.spherefed.classifier import fixed_classifier, sphere_logits, sphere_loss

LOSSES = ("mse", "ce")


@dataclass(frozen=True)
class SphereTrainer(LocalTrainer):
    """Local training of the projection (P, q) of every sampled client of a shard.

    With SCAFFOLD (option II, as on images) ``head`` also carries the server's
    c = (c_P, c_q) and ``control_rows`` maps each client to its own c_i (None
    before its first participation: zeros); every gradient gets c − c_i and the
    update returns each client's c_i⁺ = c_i − c + (θ − θ_i) / (K η).
    """

    classifier: torch.Tensor | None = None
    loss: str = "mse"

    def client_algorithm(self) -> ClientAlgorithm:
        return client_algorithm(self.sgd, partial(sphere_loss, loss=self.loss, temperature=self.sgd.temperature))

    def train(self, batch: ClientBatch, head: tuple, round_number: int,
              control_rows: dict[int, tuple[np.ndarray, np.ndarray] | None] | None) -> ShardUpdate:
        head = as_tensors(head)
        weight, bias = head[:2]
        start = {"weight": weight, "bias": bias}
        control = None if control_rows is None else {"weight": head[2], "bias": head[3]}
        sgd, algorithm = self.sgd.for_round(round_number), self.client_algorithm()
        delta_w, delta_b = torch.zeros_like(weight), torch.zeros_like(bias)
        loss_sum, total, controls = 0.0, 0, {}
        for k, client in enumerate(batch.clients.tolist()):
            rows = slice(batch.offsets[k], batch.offsets[k + 1])
            x, y = batch.features[rows], batch.labels[rows]
            with torch.no_grad():
                loss_sum += len(y) * float(algorithm.batch_loss(sphere_logits(x, weight, bias, self.classifier), y))
            trained = {name: value.clone().requires_grad_() for name, value in start.items()}
            own = None
            if control is not None and control_rows[client] is not None:
                own = dict(zip(("weight", "bias"), as_tensors(control_rows[client])))
            new = local_sgd(trained, lambda step: sphere_logits(x[step], trained["weight"], trained["bias"], self.classifier), y,
                            client_batches(len(y), sgd, self.seed, round_number, client), sgd, algorithm, start, control, own)
            if new is not None:
                controls[client] = as_arrays((new["weight"], new["bias"]))
            delta_w += len(y) * (trained["weight"].detach() - weight)
            delta_b += len(y) * (trained["bias"].detach() - bias)
            total += len(y)
        return ShardUpdate(delta_w.numpy(), delta_b.numpy(), float(total), loss_sum, total,
                           client_controls=controls if control_rows is not None else None)

    def combine(self, a: ShardUpdate, b: ShardUpdate) -> ShardUpdate:
        merged = super().combine(a, b)
        if a.client_controls is not None:
            merged.client_controls = {**a.client_controls, **b.client_controls}
        return merged


@dataclass(frozen=True)
class SphereMap:
    """The test-time feature map z = normalize(P x + q), for :class:`Evaluator`."""

    weight: torch.Tensor
    bias: torch.Tensor

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(features @ self.weight.T + self.bias, dim=1)


class SphereBackend(ProbeBackend):
    """SphereFed's training on the features of a :class:`ShardPool`; the fixed classifier never travels.

    SCAFFOLD keeps option-II control variates of the projection per client
    seen in the driver (:class:`ControlVariates`: 4 (d + 1) l bytes per client).
    """

    def __init__(self, pool: ShardPool, sgd: LocalSGD, seed: int, evaluator: Evaluator, sphere_dim: int, loss: str,
                 scaffold: bool = False) -> None:
        self.sphere_dim = sphere_dim
        self.classifier = fixed_classifier(pool.federation.num_classes, sphere_dim, seed).to(torch.float32)
        super().__init__(pool, sgd, seed, evaluator, trainer=SphereTrainer(sgd, seed, classifier=self.classifier, loss=loss))
        shapes = {"weight": torch.Size((sphere_dim, self.dim)), "bias": torch.Size((sphere_dim,))}
        self.controls = ControlVariates(shapes, int(self.offsets[-1])) if scaffold else None

    def train_round(self, params: Params, clients: np.ndarray, round_number: int) -> RoundUpdate:
        if self.controls is None:
            return super().train_round(params, clients, round_number)
        control = self.controls.control
        head = as_arrays((params["weight"], params["bias"], control["weight"], control["bias"]))
        states = [{client: self._own(client) for client in local.tolist()} for local in self.pool.split_clients(clients)]
        update: ShardUpdate = self.pool.local_train(self.trainer, self.trainer_ref, ray.put(head), clients, round_number, states).result()
        sizes = self.pool.federation.client_sizes
        new = {client: dict(zip(("weight", "bias"), as_tensors(arrays))) for client, arrays in update.client_controls.items()}
        self.controls.update(new, {client: int(sizes[client]) for client in new})
        delta_weight, delta_bias = as_tensors((update.delta_weight, update.delta_bias))
        return RoundUpdate({"weight": delta_weight, "bias": delta_bias}, update.weight, update.loss_sum, update.samples)

    def _own(self, client: int) -> tuple[np.ndarray, np.ndarray] | None:
        own = self.controls.of(client)
        return None if own is None else as_arrays((own["weight"], own["bias"]))

    def initial_params(self, seed: int) -> Params:
        """The projection d → l, initialized like every random head of a run (:func:`random_head`, transposed)."""
        projection = random_head(self.dim, self.sphere_dim, seed)
        return {"weight": projection["weight"].T.contiguous(), "bias": projection["bias"]}

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

    def traffic_floats(self) -> tuple[int, int]:
        """The projection down and its update up (SCAFFOLD: also c down, Δc_i up); the classifier is fixed and known to every client."""
        floats = (self.dim + 1) * self.sphere_dim * (2 if self.controls is not None else 1)
        return floats, floats

    def paper_costs(self, sizes: np.ndarray) -> PaperCosts:
        """Undefined: none of the papers whose conventions fedray reproduces counts SphereFed's training."""
        return PaperCosts()

    def state_dict(self) -> dict:
        return {"scaffold": self.controls.state_dict()} if self.controls is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.controls is not None:
            self.controls.load_state_dict(state["scaffold"])

    def client_flops(self, sizes: np.ndarray) -> np.ndarray:
        """Forward and backward of the projection and the fixed classifier, every local epoch."""
        return 6.0 * self.sgd.epochs * sizes * self.sphere_dim * (self.dim + self.num_classes)
