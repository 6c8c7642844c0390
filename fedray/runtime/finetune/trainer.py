"""Trainer actors: one model replica each, holding a contiguous range of clients' image paths and labels.

Like the feature shards, a trainer's state is a pure function of its
constructor arguments and of its :class:`TrainerRows` (which come with every
call, see :mod:`fedray.runtime.held`), and its calls are pure functions of
their arguments (the model is reloaded from the call's parameters every time,
and the run's settings come with the call), so Ray can restart a failed
trainer and retry its calls with the same results, and one trainer serves runs
of any mode and settings.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from fedray.core.federation import TEST, TRAIN, Federation
from fedray.data.images.reader import ImageReader
from fedray.methods.training.images import (
    ClientTrainer,
    LocalTraining,
    backbone_features,
    count_correct,
    images_entk,
    training_device,
)
from fedray.methods.finetune_model import build_model
from fedray.methods.training.backend import Params
from fedray.data.images.backbones import Backbone
from fedray.data.images.decode import ImageTransform
from fedray.runtime.held import Held
from fedray.runtime.fixed_tree import TreeSum
from fedray.runtime.client_states import ClientStates, Layout
from fedray.runtime.restarts import this_actor_was_restarted
from fedray.runtime import tensor_transfer
from fedray.methods.entk import EntkSpec


@dataclass(frozen=True)
class TrainerRows:
    """A trainer's rows: its clients' train images and labels (client after client) and its share of the test split."""

    first_client: int
    offsets: np.ndarray
    """Row offsets of clients ``first_client ..``, from 0."""
    paths: dict[str, list[str | None]]
    labels: dict[str, np.ndarray]

    @classmethod
    def of(cls, federation: Federation, clients: tuple[int, int], test_rows: tuple[int, int]) -> "TrainerRows":
        """Clients ``clients[0] .. clients[1]-1`` and test rows ``test_rows[0] .. test_rows[1]-1`` of ``federation``."""
        start, stop = federation.client_offsets[clients[0]], federation.client_offsets[clients[1]]
        splits = {TRAIN: federation.train.slice(start, stop - start),
                  TEST: federation.test.slice(test_rows[0], test_rows[1] - test_rows[0])}
        return cls(clients[0], federation.client_offsets[clients[0] : clients[1] + 1] - start,
                   {split: rows.column("image_path").to_pylist() for split, rows in splits.items()},
                   {split: rows.column("label").to_numpy().astype(np.int64) for split, rows in splits.items()})


@ray.remote(max_restarts=2, max_task_retries=2)
class Trainer:
    """One model replica; its rows arrive, as a :class:`Held` :class:`TrainerRows`, with every call."""

    def __init__(self, backbone: Backbone, num_classes: int, transform: ImageTransform, eval_batch_size: int, threads: int,
                 state_budget: int | None = None) -> None:
        torch.set_num_threads(threads)
        tensor_transfer.register()
        self.device = training_device()
        self.transform, self.threads = transform, threads
        self.model = build_model(backbone, num_classes).to(self.device)
        self.eval_batch_size = eval_batch_size
        self.held: Held | None = None
        self.client_states = ClientStates(this_actor_was_restarted(), state_budget,
                                          owner=ray.get_runtime_context().get_actor_id())

    def _load(self, held: Held) -> None:
        """Fetch the rows on the first call (after a start or a restart)."""
        if self.held == held:
            return
        rows: TrainerRows = held.get()
        self.first_client, self.offsets = rows.first_client, rows.offsets
        self.readers = {split: ImageReader(paths, self.transform, self.threads) for split, paths in rows.paths.items()}
        self.labels = {split: torch.from_numpy(labels).to(self.device) for split, labels in rows.labels.items()}
        self.held = held

    def describe(self) -> dict:
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "device": str(self.device)}

    def train(self, held: Held, training: LocalTraining, received: dict[str, Params], clients: np.ndarray,
              round_number: int, steps: np.ndarray | None = None) -> TreeSum:
        """One round's local training of ``clients`` (global numbers) from what the server sent (``received``: the
        model's ``params`` and the algorithm's ``broadcast``), each within its step budget ``steps`` (None: none), their
        uploads summed in the tree with one client a leaf over this trainer's clients; their states stay here."""
        if training.algorithm.stateful:
            self.client_states.begin_round(round_number)
        self._load(held)
        updates = []
        if len(clients):
            order = np.argsort(clients, kind="stable")
            clients = clients[order]
            rows = [np.arange(self.offsets[k], self.offsets[k + 1]) for k in clients - self.first_client]
            trainer = ClientTrainer(self.model, training, self.device)
            updates = trainer.client_updates(received["params"], received["broadcast"], clients.tolist(), rows,
                                             self.labels[TRAIN], self.readers[TRAIN], round_number, self.client_states,
                                             None if steps is None else steps[order])
        return TreeSum.of_terms(self.first_client, self.first_client + len(self.offsets) - 1, updates, operator.add)

    def combine(self, _method: Any, a: TreeSum, b: TreeSum) -> TreeSum:
        """The pairwise step of :func:`~fedray.runtime.actor_group.tree_reduce` (which passes a method this sum does
        not need): two adjacent trainers' sums merged."""
        return a.merged(b, operator.add)

    def save_client_states(self, path: str) -> None:
        self.client_states.save(Path(path))

    def restore_client_states(self, paths: list[str], first: int, end: int, layout: Layout | None = None) -> None:
        """The states of ``paths`` for clients ``first`` to ``end``, each of ``layout`` when given."""
        self.client_states.restore(map(Path, paths), lambda client: first <= client < end, lambda client: layout)

    def clear_client_states(self) -> None:
        self.client_states.clear()

    def correct(self, held: Held, params: Params) -> tuple[int, int]:
        """(correctly classified, total) over this trainer's test rows."""
        self._load(held)
        correct = count_correct(self.model, params, self.readers[TEST], self.labels[TEST], self.eval_batch_size, self.device)
        return correct, len(self.labels[TEST])

    def embed(self, held: Held, params: Params, split: str) -> tuple[torch.Tensor, np.ndarray]:
        """Backbone features (float32, CPU) and labels of this trainer's rows of ``split``, in federation order."""
        self._load(held)
        features = backbone_features(self.model, params, self.readers[split], self.eval_batch_size, self.device)
        return features.float().cpu(), self.labels[split].cpu().numpy()

    @ray.method(num_returns=2)
    def entk(self, held: Held, params: Params, spec: EntkSpec, split: str) -> tuple[torch.Tensor, np.ndarray]:
        """TCT's eNTK features (CPU, ``spec.dtype``) and labels of this trainer's rows of ``split``, in federation order."""
        self._load(held)
        features = images_entk(self.model, params, self.readers[split], spec, self.device)
        return features, self.labels[split].cpu().numpy()
