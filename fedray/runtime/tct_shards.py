"""TCT stage 2 in the sharded runtime: shard actors holding their clients' eNTK features, and the driver's side.

Each :class:`Stage2Shard` holds the eNTK features of a contiguous range of
clients (the range of the trainer that computed them, handed over through the
object store: the features never reach the driver) and an equal share of the
test split. Per call the driver sends only what a server would broadcast: the
normalization (μ, σ), the global model ψ = [W; bᵀ] ((p + 1) × C, the bias as
the last row) and SCAFFOLD's server control c. Unlike the feature shards, a
stage-2 shard keeps state between calls: its clients' control variates c_k
((p + 1) × C each, created at a client's first participation), as the clients
themselves would in TCT's algorithm.

Every upload passes through the run's postprocessing: the client hooks in the
shards, client by client (when a postprocessor has them), the aggregate hook on
the driver (:class:`Stage2Pool`'s calls).

A shard works client after client, and every sum over clients (the moments, the
closed form's statistics, a round's updates) is added in the fixed tree with one
client a leaf (:meth:`~fedray.runtime.fixed_tree.TreeSum.of_terms`): the
shards' nodes merged and rooted on the driver, the same bits on any number of
stage-2 shards. A shard holds at most one partial sum a level of that tree
(⌈log₂ n⌉ + 1 for n clients): the closed form's (p + 1)² statistics that many
times.

The maths is :mod:`fedray.methods.tct_stage2`'s, applied per client to the
standardized features with the intercept appended (``with_intercept``), for
training and scoring alike: the sharded solver equals
the in-memory reference solver of the tests run on the same standardized clients.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from functools import reduce
from typing import Any

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup

from fedray.methods.algorithm import Upload
from fedray.methods.postprocessor import Postprocessing
from fedray.methods.training.images import training_device
from fedray.runtime import tensor_transfer
from fedray.runtime.actor_group import ActorGroup, tree_reduce
from fedray.runtime.fixed_tree import TreeSum, merge_with, root_of
from fedray.methods.tct_stage2 import (
    STD_FLOOR,
    Moments,
    TctStage2Options,
    client_loss,
    control_after,
    local_delta,
    normalize,
    random_projection,
    row_blocks,
    stage2_statistics,
    targets,
    with_intercept,
)


@dataclass(frozen=True)
class Normalization:
    """The server's broadcast after the normalization round: per-coordinate μ and σ (float64)."""

    mean: torch.Tensor
    std: torch.Tensor


@dataclass
class RoundSums:
    """A round's sums over participants: Σ w_k Δ_k, Σ w_k, Σ w_k (c_k⁺ − c_k) and Σ w_k F_k(W) at the round's start."""

    delta: torch.Tensor
    weight: float
    control_change: torch.Tensor | None
    loss: float

    def __add__(self, other: RoundSums) -> RoundSums:
        change = None if self.control_change is None else self.control_change + other.control_change
        return RoundSums(self.delta + other.delta, self.weight + other.weight, change, self.loss + other.loss)


@dataclass
class Statistics:
    """The closed form's uploads summed over clients: XᵀX and XᵀY of the standardized features with the intercept (float64)."""

    matrix: torch.Tensor
    rhs: torch.Tensor

    def __add__(self, other: Statistics) -> Statistics:
        return Statistics(self.matrix + other.matrix, self.rhs + other.rhs)


@dataclass(frozen=True)
class Projection:
    """Stage 2 on Rᵀz: the seeded Gaussian projection to ``dim`` coordinates (see :func:`~fedray.methods.tct_stage2.random_projection`)."""

    dim: int
    seed: int

    @classmethod
    def of(cls, options: TctStage2Options, seed: int) -> Projection | None:
        """The projection ``options`` ask for (``tct_projection``), drawn from ``seed``; None: none."""
        return None if options.tct_projection is None else cls(options.tct_projection, seed)


@dataclass(frozen=True)
class LocalSolver:
    """Stage 2's client settings: K full-batch steps at learning rate η on ``loss`` (``mse`` or ``ce``, see
    :data:`~fedray.methods.tct_stage2.LOSSES`), with SCAFFOLD's correction or without it (FedAvg: no control variates
    kept, sent or uploaded)."""

    steps: int
    lr: float
    correction: bool = True
    loss: str = "mse"

    @classmethod
    def of(cls, options: TctStage2Options) -> LocalSolver:
        return cls(options.tct_local_steps, options.tct_lr, options.corrected, options.tct_loss)


def _on_cpu(total: Any) -> Any:
    """A sum (:class:`Moments`, :class:`Statistics`, :class:`RoundSums`) with its tensors on the CPU: the driver adds
    the shards' nodes."""
    return replace(total, **{field.name: getattr(total, field.name).cpu() for field in fields(total)
                             if isinstance(getattr(total, field.name), torch.Tensor)})


@ray.remote(max_restarts=0)
class Stage2Shard:
    """Clients ``first_client ..`` with row ``offsets`` (local, from 0) into ``train``'s features; ``test``: its test rows.

    ``train`` and ``test`` are the features (n × p) the trainers' ``entk``
    returned, projected by ``projection`` when given (each client would do it
    with the shared seed). Features are kept in their storage dtype (float16
    halves memory) and standardized per use into ``float32`` (or float64 when
    stored so) on the shard's device.
    """

    def __init__(self, train: torch.Tensor, train_labels: np.ndarray, test: torch.Tensor, test_labels: np.ndarray,
                 offsets: np.ndarray, first_client: int, num_classes: int, projection: Projection | None, threads: int) -> None:
        torch.set_num_threads(threads)
        tensor_transfer.register()
        self.device = training_device()
        self.features = {"train": train.to(self.device), "test": test.to(self.device)}
        if projection is not None:
            self.features = {split: random_projection(features, projection.dim, projection.seed)
                             for split, features in self.features.items()}
        self.labels = {"train": torch.from_numpy(train_labels).to(self.device), "test": torch.from_numpy(test_labels).to(self.device)}
        stored = train.dtype
        self.dtype = torch.float64 if stored == torch.float64 else torch.float32
        self.offsets, self.first_client, self.num_classes = offsets, first_client, num_classes
        self.controls: dict[int, torch.Tensor] = {}

    def _rows(self, client: int) -> slice:
        """Client ``client``'s rows in this shard's features."""
        local = client - self.first_client
        return slice(int(self.offsets[local]), int(self.offsets[local + 1]))

    @property
    def end_client(self) -> int:
        """The client after this shard's last."""
        return self.first_client + len(self.offsets) - 1

    def _summed(self, terms: Iterable[tuple[int, Any]]) -> TreeSum:
        """``terms`` (client, value), in increasing client order, as the nodes of the tree with one client a leaf over
        this shard's clients."""
        return TreeSum.of_terms(self.first_client, self.end_client, terms, operator.add).mapped(_on_cpu)

    def _every_client(self, uploads: Postprocessing | None, round_number: int,
                      upload_of: Callable[[slice], Any]) -> TreeSum:
        """Every client's upload (``upload_of`` its rows), each through ``uploads``' client hooks when given, summed."""
        def upload(client: int) -> Any:
            value = upload_of(self._rows(client))
            return value if uploads is None else uploads.statistics(value, client, round_number)
        return self._summed((client, upload(client)) for client in range(self.first_client, self.end_client))

    def _client(self, client: int, normalization: Normalization, loss: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``client``'s design [Z̃_k, 1] and targets of ``loss``, in the shard's compute dtype."""
        rows = self._rows(client)
        features = with_intercept(normalize(self.features["train"][rows], *self._on_device(normalization), dtype=self.dtype))
        return features, targets(self.labels["train"][rows], self.num_classes, self.dtype, loss)

    def _on_device(self, normalization: Normalization) -> tuple[torch.Tensor, torch.Tensor]:
        return normalization.mean.to(self.device), normalization.std.to(self.device)

    def moments(self, uploads: Postprocessing | None = None, round_number: int = 0) -> TreeSum:
        """The normalization round: this shard's clients' (n_k, Σ z, Σ z²) uploads in float64, summed (each through
        ``uploads``' client hooks, in round ``round_number``, when given)."""
        features = self.features["train"]
        return self._every_client(uploads, round_number, lambda rows: Moments.of(features[rows]))

    def statistics(self, normalization: Normalization, uploads: Postprocessing | None = None,
                   round_number: int = 0) -> TreeSum:
        """The closed form's uploads of this shard's clients, summed (each through ``uploads``' client hooks, in round
        ``round_number``, when given)."""
        mean, std = self._on_device(normalization)
        return self._every_client(uploads, round_number, lambda rows: self._statistics(rows, mean, std))

    def _statistics(self, rows: slice, mean: torch.Tensor, std: torch.Tensor) -> Statistics:
        """XᵀX and XᵀY of ``rows``, standardized in float64 a block of rows at a time."""
        features, labels = self.features["train"][rows], self.labels["train"][rows]
        return reduce(operator.add, [
            Statistics(*stage2_statistics(normalize(features[block], mean, std, torch.float64), labels[block], self.num_classes))
            for block in row_blocks(len(features))])

    def train(self, solver: LocalSolver, normalization: Normalization, model: torch.Tensor, control: torch.Tensor,
              clients: np.ndarray, weights: np.ndarray, uploads: Postprocessing | None = None,
              round_number: int = 0) -> TreeSum:
        """One round's local work of ``clients`` (global numbers, aggregation weights w_k), summed.

        A client uploads Δ_k (``delta``) and c_k⁺ − c_k (``control_change``) with weight w_k, through ``uploads``'
        client hooks when given (its own c_k⁺ stays as computed); its term is w_k · Δ_k (the tensors as they are where
        a hook asks for exact sums: w_k · Δ_k in float64 already).
        """
        model, control = model.to(self.device, self.dtype), control.to(self.device, self.dtype)
        exact = uploads is not None and uploads.exact  # w_k · t_k in float64, added as they are (Postprocessor.exact_sum)

        def term(client: int, weight: float) -> RoundSums:
            features, target = self._client(client, normalization, solver.loss)
            own = self.controls.get(client, torch.zeros_like(model))
            correction = own - control if solver.correction else torch.zeros_like(model)
            loss = weight * client_loss(features, target, model, solver.loss)
            step = local_delta(features, target, model, correction, solver.steps, solver.lr, solver.loss)
            tensors = {"delta": step}
            if solver.correction:
                updated = control_after(own, control, step, solver.steps, solver.lr)
                tensors["control_change"] = updated - own
                self.controls[client] = updated
            upload = Upload(tensors, weight)
            processed = upload if uploads is None else uploads.client(upload, client, round_number)
            scale = 1.0 if exact else processed.weight
            change = scale * processed.tensors["control_change"] if solver.correction else None
            return RoundSums(scale * processed.tensors["delta"], processed.weight, change, loss)

        order = np.argsort(clients, kind="stable")
        return self._summed((client, term(client, weight))
                            for client, weight in zip(clients[order].tolist(), weights[order].tolist()))

    def combine(self, _method: object, a: TreeSum, b: TreeSum) -> TreeSum:
        """The pairwise step of :func:`~fedray.runtime.actor_group.tree_reduce`: two adjacent shards' sums merged."""
        return a.merged(b, operator.add)

    def correct(self, normalization: Normalization, model: torch.Tensor) -> tuple[int, int]:
        """(correctly classified, total) test rows by argmax of Z̃ W + 1 bᵀ, Z̃ the standardized features and ``model`` = [W; bᵀ]."""
        mean, std = self._on_device(normalization)
        features, model = self.features["test"], model.to(self.device, self.dtype)
        correct = sum(
            int(((with_intercept(normalize(features[rows], mean, std, self.dtype)) @ model).argmax(dim=1) == self.labels["test"][rows]).sum())
            for rows in row_blocks(len(features))
        )
        return correct, len(features)


@dataclass(kw_only=True)
class Stage2Pool(ActorGroup):
    """The driver's handle on the stage-2 shards (in a placement group of their own): their client ranges and calls."""

    @classmethod
    def start(cls, train: list[ray.ObjectRef], train_labels: list[np.ndarray], test: list[ray.ObjectRef],
              test_labels: list[np.ndarray], bounds: np.ndarray, client_offsets: np.ndarray, num_classes: int,
              bundle: dict[str, float], projection: Projection | None, trial_group: PlacementGroup | None = None) -> Stage2Pool:
        """One shard per trainer range ``bounds[s] .. bounds[s+1]``, from the refs of that trainer's features.

        Inside a Tune trial the shards take the stage-1 trainers' bundles (1..) of ``trial_group``.
        """
        arguments = [
            (train[s], train_labels[s], test[s], test_labels[s],
             client_offsets[bounds[s] : bounds[s + 1] + 1] - client_offsets[bounds[s]], int(bounds[s]), num_classes,
             projection, max(1, int(bundle.get("CPU", 1))))
            for s in range(len(train))
        ]
        return cls.launch(Stage2Shard, bundle, arguments, bounds, what=f"{len(train)} stage-2 shards × {bundle}",
                          hint="lower num_trainers or cpus_per_trainer", trial_group=trial_group,
                          ready=lambda shards: ray.get([shard.__ray_ready__.remote() for shard in shards]))

    def normalization(self, eps: float = STD_FLOOR, uploads: Postprocessing = Postprocessing(),
                      round_number: int = 0) -> Normalization:
        """The normalization round: μ and σ from every client's moments (see :meth:`~fedray.methods.tct_stage2.Moments.normalization`),
        through ``uploads`` in round ``round_number``."""
        hooks = uploads if uploads.per_client else None
        moments = self._summed([(shard.moments.remote(hooks, round_number), shard) for shard in self.actors])
        return Normalization(*uploads.aggregate(moments, round_number, self.num_clients).normalization(eps))

    def statistics(self, normalization: ray.ObjectRef, uploads: Postprocessing = Postprocessing(),
                   round_number: int = 0) -> Statistics:
        """Every client's closed-form upload, summed, through ``uploads`` in round ``round_number``."""
        hooks = uploads if uploads.per_client else None
        total = self._summed([(shard.statistics.remote(normalization, hooks, round_number), shard)
                              for shard in self.actors])
        return uploads.aggregate(total, round_number, self.num_clients)

    def train(self, solver: ray.ObjectRef, normalization: ray.ObjectRef, model: ray.ObjectRef, control: ray.ObjectRef,
              clients: np.ndarray, weights: np.ndarray, uploads: Postprocessing = Postprocessing(),
              round_number: int = 0) -> RoundSums:
        """One round (``round_number``) of ``clients`` with aggregation weights ``weights``, summed, through
        ``uploads``."""
        hooks = ray.put(uploads) if uploads.per_client else None
        shard_of = self.owners(clients)
        partials = [
            (shard.train.remote(solver, normalization, model, control, clients[shard_of == s], weights[shard_of == s],
                                hooks, round_number), shard)
            for s, shard in enumerate(self.actors)
        ]
        return uploads.aggregate(self._summed(partials), round_number, len(clients))

    def _summed(self, partials: list[tuple[ray.ObjectRef, Any]]) -> Any:
        """The shards' sums (their :class:`~fedray.runtime.fixed_tree.TreeSum`, one client a leaf) merged and rooted."""
        return tree_reduce(None, partials, merge_with(operator.add),
                           finish=root_of(self.num_clients, operator.add)).result()

    @property
    def num_clients(self) -> int:
        return int(self.bounds[-1])

    def accuracy(self, normalization: ray.ObjectRef, model: ray.ObjectRef) -> float:
        counts = ray.get([shard.correct.remote(normalization, model) for shard in self.actors])
        return sum(c for c, _ in counts) / max(sum(t for _, t in counts), 1)
