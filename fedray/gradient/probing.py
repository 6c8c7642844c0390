"""Federated linear probing on frozen features: FedAvg-family rounds on the shard runtime.

Per round the global head (W, b) is put in the object store once; each shard
trains its sampled clients together (:func:`~fedray.gradient.local.train_heads`)
and returns Σ n_k (θ_k − θ) and Σ n_k; the sums are tree-reduced, and the server
turns their ratio Δ into the next head with its optimizer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import ray
import torch
from tqdm import tqdm

from fedray.evaluation import Evaluator
from fedray.gradient.local import LocalSGD, train_heads
from fedray.gradient.server import ServerOptimizer
from fedray.methods.base import FLOAT_BYTES, ClientBatch, Classifier
from fedray.results import EvalPoint
from fedray.runtime.shards import ShardPool
from fedray.runtime.simulation import eval_rounds

Update = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LocalTrainer:
    """What every shard runs in a round; put in the object store once per run."""

    sgd: LocalSGD
    seed: int

    def train(self, batch: ClientBatch, head: tuple[torch.Tensor, torch.Tensor], round_number: int) -> Update:
        weight, bias = head
        heads = train_heads(batch.features, batch.labels, batch.offsets, batch.clients, weight, bias, self.sgd, self.seed, round_number)
        return heads.weighted_update(bias)

    def combine(self, a: Update, b: Update) -> Update:
        return a[0] + b[0], a[1] + b[1], a[2] + b[2]

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def client_flops(self, sizes: np.ndarray, dim: int, num_classes: int) -> np.ndarray:
        """Forward (2ndC) and backward (4ndC) passes of the head over every local epoch: the primal count the papers use."""
        return 6.0 * self.sgd.epochs * sizes * dim * num_classes


def run_linear_probe(
    pool: ShardPool,
    trainer: LocalTrainer,
    server: ServerOptimizer,
    head: Classifier,
    rounds: list[np.ndarray],
    eval_every: int,
    evaluator: Evaluator,
    quiet: bool = False,
) -> tuple[list[EvalPoint], Classifier]:
    """Train ``head`` for ``rounds``; one :class:`EvalPoint` per evaluation. ``head`` needs a bias."""
    start = time.perf_counter()
    federation = pool.federation
    sizes = federation.client_sizes
    dim, num_classes = head.weight.shape
    model_bytes = (dim * num_classes + num_classes) * FLOAT_BYTES
    client_flops = trainer.client_flops(sizes.astype(np.float64), dim, num_classes)
    params = {"weight": head.weight.clone(), "bias": head.bias.clone()}
    trainer_ref = ray.put(trainer)
    seen = np.zeros(federation.num_clients, dtype=bool)
    evaluate_at = eval_rounds(len(rounds), eval_every)
    points: list[EvalPoint] = []
    flops = 0.0
    participations = 0
    with tqdm(total=len(rounds), unit="round", disable=quiet, desc="linear probe") as progress:
        for number, clients in enumerate(rounds, start=1):
            head_ref = ray.put((params["weight"], params["bias"]))
            delta_w, delta_b, count = ray.get(pool.local_train(trainer_ref, head_ref, clients, number))
            server.step(params, {"weight": delta_w / count, "bias": delta_b / count})
            seen[clients] = True
            flops += float(client_flops[clients].sum())
            participations += len(clients)
            if number in evaluate_at:
                accuracy = evaluator.accuracy(trainer, Classifier(params["weight"], params["bias"]))
                traffic = participations * model_bytes
                points.append(EvalPoint(number, int(seen.sum()), int(sizes[seen].sum()), accuracy, traffic, traffic,
                                        flops / participations, time.perf_counter() - start))
                progress.set_postfix(acc=f"{accuracy:.4f}")
            progress.update(1)
    return points, Classifier(params["weight"], params["bias"])
