"""Federated linear probing on frozen features: the shard runtime as a training backend.

Per round the global head (W, b) is put in the object store once; each shard
trains its sampled clients together (:func:`~fedray.gradient.heads.train_linear_heads`)
and returns Σ n_k (θ_k − θ) and Σ n_k; the sums are tree-reduced and the
training loop turns their ratio into the next head with the server optimizer.

SCAFFOLD's client control variates live in the driver as one n × C matrix
G of all training samples (c_i = X_iᵀ G_i, see :class:`~fedray.gradient.local.Control`),
120,293 × 1,203 floats (0.58 GB) for iNat-User-120K instead of one d × C
matrix per client (57 GB); each round sends a shard only its clients' rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import ray
import torch

from fedray.accounting import PaperCosts
from fedray.runtime.evaluator import Evaluator
from fedray.gradient.backend import Params, RoundUpdate
from fedray.gradient.client_sgd import ClientAlgorithm, CrossEntropy, client_algorithm
from fedray.gradient.heads import train_linear_heads
from fedray.gradient.local import Control, LocalSGD, random_head
from fedray.methods.base import Classifier, ClientBatch
from fedray.runtime.shards import ShardPool, gather_rows


def as_arrays(tensors: tuple[torch.Tensor, ...]) -> tuple[np.ndarray, ...]:
    """Tensors as NumPy arrays for Ray: those travel as zero-copy buffers, a torch tensor is pickled (6× slower for a head)."""
    return tuple(t.numpy() for t in tensors)


def as_tensors(arrays: tuple[np.ndarray, ...]) -> tuple[torch.Tensor, ...]:
    """Writable tensors from arrays Ray handed over read-only."""
    return tuple(torch.from_numpy(np.array(a)) for a in arrays)


@dataclass
class ShardUpdate:
    """A shard's (or a reduced set of shards') sums, as arrays; SCAFFOLD adds control-variate sums and new rows."""

    delta_weight: np.ndarray
    delta_bias: np.ndarray
    weight: float
    loss_sum: float
    samples: int
    control_weight: np.ndarray | None = None
    control_bias: np.ndarray | None = None
    clients: np.ndarray | None = None
    gradient_rows: np.ndarray | None = None
    client_controls: dict[int, tuple[np.ndarray, ...]] | None = None


@dataclass(frozen=True)
class LocalTrainer:
    """What every shard runs in a round; put in the object store once per run."""

    sgd: LocalSGD
    seed: int

    def client_algorithm(self) -> ClientAlgorithm:
        """The clients' objective on the cross-entropy at ``sgd``'s temperature (``sgd``'s plugin, else FedAvg's, FedProx's, SCAFFOLD's)."""
        return client_algorithm(self.sgd, CrossEntropy(self.sgd.temperature))

    def train(self, batch: ClientBatch, head: tuple, round_number: int, control_rows: np.ndarray | None) -> ShardUpdate:
        """``head`` is (W, b), or (W, b, c_W, c_b) for SCAFFOLD with ``control_rows`` the clients' G rows (arrays).

        The dual form trains the heads when it supports the algorithm, autograd otherwise (:mod:`fedray.gradient.heads`).
        """
        head = as_tensors(head)
        weight, bias = head[:2]
        control = None if control_rows is None else Control(head[2], head[3], torch.from_numpy(np.array(control_rows)))
        heads = train_linear_heads(batch.features, batch.labels, batch.offsets, batch.clients, weight, bias, self.sgd,
                                   self.client_algorithm(), self.seed, round_number, control)
        delta_w, delta_b, count = heads.weighted_update(bias)
        update = ShardUpdate(delta_w.numpy(), delta_b.numpy(), float(count), heads.start_loss, len(batch.labels))
        if control is not None:
            update.control_weight, update.control_bias = as_arrays(heads.control_update())
            update.clients, update.gradient_rows = batch.clients, heads.gradient_rows.numpy()
        return update

    def combine(self, a: ShardUpdate, b: ShardUpdate) -> ShardUpdate:
        merged = ShardUpdate(a.delta_weight + b.delta_weight, a.delta_bias + b.delta_bias, a.weight + b.weight,
                             a.loss_sum + b.loss_sum, a.samples + b.samples)
        if a.control_weight is not None:
            merged.control_weight = a.control_weight + b.control_weight
            merged.control_bias = a.control_bias + b.control_bias
            merged.clients = np.concatenate([a.clients, b.clients])
            merged.gradient_rows = np.concatenate([a.gradient_rows, b.gradient_rows])
        return merged

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        return features


class ProbeBackend:
    """Linear probing of a softmax head on the features held by a :class:`ShardPool`."""

    statistics_names: frozenset[str] = frozenset()

    def __init__(self, pool: ShardPool, sgd: LocalSGD, seed: int, evaluator: Evaluator, scaffold: bool = False,
                 trainer: LocalTrainer | None = None) -> None:
        """``trainer`` replaces the softmax head's local training (SphereFed's projection)."""
        self.pool, self.sgd, self.evaluator, self.scaffold = pool, sgd, evaluator, scaffold
        self.trainer = trainer or LocalTrainer(sgd, seed)
        self.trainer_ref = ray.put(self.trainer)
        federation = pool.federation
        self.dim, self.num_classes = federation.dim, federation.num_classes
        self.offsets = federation.client_offsets
        self.control: dict[str, torch.Tensor] = {}
        if scaffold:
            self.control = {
                "weight": torch.zeros(self.dim, self.num_classes),
                "bias": torch.zeros(self.num_classes),
                "rows": torch.zeros(int(self.offsets[-1]), self.num_classes),
            }

    def train_round(self, params: Params, clients: np.ndarray, round_number: int) -> RoundUpdate:
        head = (params["weight"], params["bias"])
        states = None
        if self.scaffold:
            head += (self.control["weight"], self.control["bias"])
            states = [self.control["rows"][torch.from_numpy(gather_rows(self.offsets, local)[0])].numpy()
                      for local in self.pool.split_clients(clients)]
        reduced = self.pool.local_train(self.trainer, self.trainer_ref, ray.put(as_arrays(head)), clients, round_number, states)
        update: ShardUpdate = reduced.result()
        if self.scaffold:
            self._update_control(update)
        delta_weight, delta_bias = as_tensors((update.delta_weight, update.delta_bias))
        return RoundUpdate({"weight": delta_weight, "bias": delta_bias}, update.weight, update.loss_sum, update.samples)

    def _update_control(self, update: ShardUpdate) -> None:
        """c ← c + Σ n_i Δc_i / N: c stays the sample-weighted mean of all clients' c_i (zero until first seen)."""
        total = float(self.offsets[-1])
        control_weight, control_bias, gradient_rows = as_tensors((update.control_weight, update.control_bias, update.gradient_rows))
        self.control["weight"] += control_weight / total
        self.control["bias"] += control_bias / total
        rows, _ = gather_rows(self.offsets, update.clients)
        self.control["rows"][torch.from_numpy(rows)] = gradient_rows

    def initial_params(self, seed: int) -> Params:
        return random_head(self.dim, self.num_classes, seed)

    def with_head(self, params: Params, head: Params) -> Params:
        return {**params, **head}

    def head(self, params: Params) -> Classifier:
        return Classifier(params["weight"].clone(), params["bias"].clone())

    def accuracy(self, params: Params) -> float:
        return self.evaluator.accuracy(self.trainer, Classifier(params["weight"], params["bias"]))

    def traffic_floats(self) -> tuple[int, int]:
        """The head down and its update up; SCAFFOLD also sends c down and Δc_i up."""
        floats = (self.dim + 1) * self.num_classes * (2 if self.scaffold else 1)
        return floats, floats

    def client_flops(self, sizes: np.ndarray) -> np.ndarray:
        """Forward (2ndC) and backward (4ndC) passes of the head over every local epoch: the primal count the papers use."""
        return 6.0 * self.sgd.epochs * sizes * self.dim * self.num_classes

    def paper_costs(self, sizes: np.ndarray) -> PaperCosts:
        """Linear probing as the papers count it, the head being d·C floats (no bias) and its forward d·C multiply-adds:
        FedCOF App. H 2·d·C per participation (SCAFFOLD undefined); Fed3R App. D d·C down and up (Scaffold-LP twice
        that), App. E E·n_k(F_φ + 3·d·C); FedNCM one backbone forward per sample and epoch, as on images.
        FedAvgM, FedAdam and FedProx clients send and compute what FedAvg's do."""
        head = float(self.dim * self.num_classes)
        passes = self.sgd.epochs * sizes
        per_client = np.ones_like(passes)
        return PaperCosts(
            fedcof_floats=None if self.scaffold else 2 * head * per_client,
            fed3r_floats=(4 if self.scaffold else 2) * head * per_client,
            fed3r_macs=3 * head * passes,
            forward_passes=passes,
        )

    def state_dict(self) -> dict:
        return {name: tensor.clone() for name, tensor in self.control.items()}

    def load_state_dict(self, state: dict) -> None:
        self.control = {name: tensor.clone() for name, tensor in state.items()}
