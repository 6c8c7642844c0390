"""Federated linear probing on frozen features: the shard runtime as a training backend.

Per round the global head (W, b) and the algorithm's broadcast are put in the
object store once; each shard trains its sampled clients together
(:func:`~fedray.methods.training.heads.train_linear_heads`), keeps their states and
returns the sums of their uploads; the sums are tree-reduced and the training
loop (:mod:`fedray.engine.training`) turns them into the next head with the
algorithm's server half and the server optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import ray
import torch

from fedray.core.accounting import PaperCosts
from fedray.methods.training.backend import RoundUpdate
from fedray.methods.training.held_updates import Arrival
from fedray.methods.training.budgets import checked_budgets, full_steps
from fedray.methods.training.dual_form import dual_form
from fedray.methods.training.heads import ROWS, Parts, States, train_linear_heads
from fedray.methods.training.local import LocalSGD, random_head
from fedray.methods.algorithm import FederatedAlgorithm, Params
from fedray.methods.base import Classifier, ClientBatch
from fedray.methods.postprocessor import Postprocessing
from fedray.methods.training_algorithms import paper_family
from fedray.runtime.evaluator import Evaluator
from fedray.runtime.client_states import Layout, meta_layout
from fedray.runtime.shards import ShardPool


@dataclass(frozen=True)
class LocalTrainer:
    """What every shard runs in a round (put in the object store once per run): its clients' local training, and with
    ``client_losses`` the measure of each client's squared losses (:class:`RoundUpdate`'s ``client_losses``)."""

    sgd: LocalSGD
    seed: int
    algorithm: FederatedAlgorithm
    postprocessing: Postprocessing = Postprocessing()
    client_losses: bool = False

    @property
    def stateful(self) -> bool:
        return self.algorithm.stateful

    def train(self, batch: ClientBatch, received: dict[str, Params], round_number: int, states: States,
              steps: np.ndarray | None = None, parts: Parts | None = None) -> list[RoundUpdate | None]:
        """``received`` holds the model (``params``) and the algorithm's ``broadcast``; ``steps``: each client's step
        budget (None: none); the uploads summed per part of the clients (``parts``, None: one; see
        :func:`~fedray.methods.training.heads.train_linear_heads`)."""
        return train_linear_heads(batch, received["params"], received["broadcast"], self.sgd, self.algorithm, self.seed,
                                  round_number, states, self.postprocessing, steps, self.client_losses, parts)

    def state_layout(self, shapes: Layout) -> Layout | None:
        """The shapes of a client's state when it trains parameters of ``shapes`` (-1: its samples): SCAFFOLD's dual
        form keeps its gradient rows (samples × C), an algorithm trained by autograd what its ``init_client_state``
        makes."""
        dual = dual_form(self.algorithm)
        if dual is not None and dual.control:
            return {ROWS: (-1, shapes["bias"][0])}
        return meta_layout(self.algorithm, shapes)

    def combine(self, a: RoundUpdate, b: RoundUpdate) -> RoundUpdate:
        return a + b

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        return features


class ProbeBackend:
    """Linear probing of a softmax head on the features held by a :class:`ShardPool`."""

    trained_names: frozenset[str] | None = None

    def __init__(self, pool: ShardPool, sgd: LocalSGD, seed: int, evaluator: Evaluator, algorithm: FederatedAlgorithm,
                 trainer: LocalTrainer | None = None, postprocessing: Postprocessing = Postprocessing(),
                 client_losses: bool = False) -> None:
        """``trainer`` replaces the softmax head's local training (SphereFed's projection); ``client_losses``: each
        round measures its clients' squared losses."""
        self.pool, self.sgd, self.evaluator, self.algorithm = pool, sgd, evaluator, algorithm
        self.trainer = trainer or LocalTrainer(sgd, seed, algorithm, postprocessing, client_losses)
        self.trainer_ref = ray.put(self.trainer)
        federation = pool.federation
        self.dim, self.num_classes = federation.dim, federation.num_classes

    def train_round(self, params: Params, broadcast: Params, clients: np.ndarray, round_number: int,
                    steps: np.ndarray | None = None) -> RoundUpdate:
        steps = checked_budgets(steps, clients)
        received = ray.put({"params": params, "broadcast": broadcast})
        trainer, trainer_ref = self.trainer, self.trainer_ref
        if trainer.postprocessing.per_client:  # the client hooks told the round's participants (secure aggregation's)
            trainer = replace(trainer, postprocessing=trainer.postprocessing.among(clients, round_number))
            trainer_ref = ray.put(trainer)
        return self.pool.local_train(trainer, trainer_ref, received, clients, round_number, steps).result()

    def hold_batches(self, params: Params, broadcast: Params, batches: list[tuple[np.ndarray, Arrival]],
                     round_number: int, first: bool) -> None:
        """:meth:`train_round` of each of ``batches`` (distinct clients each) from the same ``params``, each sum held
        beside the shards for the step of its :class:`Arrival`, until :meth:`take_held` (``first``: the run's first
        batches, which drop whatever an earlier run left held). The model is put in the object store once and every
        batch queued at once, so that a model version's many small batches run back to back; the sums, added in the
        order of ``batches``, are the bits the driver would add."""
        received = ray.put({"params": params, "broadcast": broadcast})
        if first:
            self.pool.hold_from_now()
        for clients, arrival in batches:
            self.pool.local_train(self.trainer, self.trainer_ref, received, clients, round_number, hold=arrival)

    def take_held(self, step: int) -> RoundUpdate | None:
        """The sum of the updates held for server step ``step`` (None: none)."""
        return self.pool.take_held(step)

    def local_steps(self, clients: np.ndarray) -> np.ndarray:
        return full_steps(np.diff(self.pool.federation.client_offsets)[clients], self.sgd.batch_size, self.sgd.epochs)

    def initial_params(self, seed: int) -> Params:
        return random_head(self.dim, self.num_classes, seed)

    def client_state_layout(self) -> Layout | None:
        return self.trainer.state_layout({name: tuple(value.shape) for name, value in self.initial_params(0).items()})

    def with_head(self, params: Params, head: Params) -> Params:
        return {**params, **head}

    def calibration_map(self, params: Params) -> tuple[None, None]:
        """A calibration (``--calibrate``) runs on the frozen features themselves."""
        return None, None

    def head(self, params: Params) -> Classifier:
        return Classifier(params["weight"].clone(), params["bias"].clone())

    def accuracy(self, params: Params) -> float:
        return self.evaluator.accuracy(self.trainer, Classifier(params["weight"], params["bias"]))

    def model_floats(self) -> int:
        """The head (W, b)."""
        return (self.dim + 1) * self.num_classes

    def client_flops(self, sizes: np.ndarray) -> np.ndarray:
        """Forward (2ndC) and backward (4ndC) passes of the head over every local epoch: the primal count the papers use."""
        return 6.0 * self.sgd.epochs * sizes * self.dim * self.num_classes

    def paper_costs(self, sizes: np.ndarray) -> PaperCosts:
        """Linear probing as the papers count it, the head being d·C floats (no bias) and its forward d·C multiply-adds:
        FedCOF App. H 2·d·C per participation (SCAFFOLD undefined); Fed3R App. D d·C down and up (Scaffold-LP twice
        that), App. E E·n_k(F_φ + 3·d·C); FedNCM one backbone forward per sample and epoch, as on images.
        FedAvgM, FedAdam, FedAdagrad, FedYogi and FedProx clients send and compute what FedAvg's do; the papers count no
        other algorithm."""
        family = paper_family(self.algorithm)
        if family is None:
            return PaperCosts()
        scaffold = family == "scaffold"
        head = float(self.dim * self.num_classes)
        passes = self.sgd.epochs * sizes
        per_client = np.ones_like(passes)
        return PaperCosts(
            fedcof_floats=None if scaffold else 2 * head * per_client,
            fed3r_floats=(4 if scaffold else 2) * head * per_client,
            fed3r_macs=3 * head * passes,
            forward_passes=passes,
        )
