"""The trainer pool: a federation's images spread over model replicas in a placement group.

One bundle per trainer: ``{"GPU": g, "CPU": c}`` when the cluster has GPUs (g = 1, or a share of one when
there are more trainers than GPUs),
``{"CPU": c}`` otherwise. Trainers hold contiguous, sample-balanced ranges of
clients (as the feature shards do) and equal shares of the test split. The
pool knows nothing of a run's mode or optimizer, so runs of different settings
(a sweep) can share it and skip the replicas' start-up (seconds each: torch
and torchvision are imported in every new process).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
import ray
import torch
from ray.util.placement_group import PlacementGroup

from fedray.core.federation import TEST, TRAIN, Federation
from fedray.core.errors import FedrayError
from fedray.methods.training.backend import RoundUpdate
from fedray.runtime.finetune.trainer import Trainer, TrainerRows
from fedray.data.images.backbones import Backbone, get_backbone, images_backbone
from fedray.data.images.decode import ImageTransform
from fedray.runtime.held import Held
from fedray.runtime.kept import default_budget
from fedray.runtime.actor_group import ActorGroup, balanced_bounds, fetch, tree_reduce
from fedray.runtime.fixed_tree import merge_with, root_of
from fedray.runtime.placement import default_count, gpu_share, trial_bundles
from fedray.methods.entk import EntkSpec


def check_images(federation: Federation) -> None:
    """Every sample of both splits must name an image file (existence and decoding are checked when it is read)."""
    table = federation.table
    if "image_path" not in table.column_names:
        raise FedrayError(f"{federation.name}: no images to fine-tune on (an hsu: split needs images=ROOT)")
    missing = table.filter(pc.is_null(table.column("image_path")))
    if missing.num_rows:
        column = "image_id" if "image_id" in missing.column_names else "sample_id"
        raise FedrayError(
            f"{federation.name}: image {missing.column(column)[0].as_py()!r} ({missing.num_rows} in all) not found under the image root"
        )


@dataclass(kw_only=True)
class TrainerPool(ActorGroup):
    """The trainers and each trainer's rows (sent with every call: a restarted trainer needs them again)."""

    keeps_client_states = True

    federation: Federation
    backbone: Backbone
    image_size: int
    rows: list[Held]

    @classmethod
    def start(
        cls,
        federation: Federation,
        backbone_name: str,
        *,
        image_size: int = 224,
        num_trainers: int | None = None,
        cpus_per_trainer: float = 1.0,
        eval_batch_size: int = 64,
        trial_group: PlacementGroup | None = None,
        state_budget: int | None = None,
    ) -> TrainerPool:
        """Reserve one bundle per trainer and start the trainers (default: one per GPU, else as many as the free CPUs fit).

        Inside a Tune trial, the trainers take bundles 1.. of ``trial_group``
        instead (bundle 0 is the trial's driver; see
        :meth:`~fedray.runtime.shards.ShardPool.start`): one trainer per bundle,
        with its resources, whatever ``num_trainers`` and ``cpus_per_trainer`` say. ``state_budget``: bytes of
        clients' states each trainer keeps in memory (see :meth:`~fedray.runtime.shards.ShardPool.start`).
        """
        backbone = get_backbone(backbone_name)
        if backbone.fixed_size is not None and image_size != backbone.fixed_size:
            raise FedrayError(f"{backbone.name} takes {backbone.fixed_size}-pixel images, got image size {image_size}")
        if cpus_per_trainer <= 0 or eval_batch_size < 1:
            raise FedrayError(f"need cpus_per_trainer > 0 and eval_batch_size ≥ 1, got {cpus_per_trainer} and {eval_batch_size}")
        check_images(federation)
        backbone = images_backbone(backbone_name, federation)  # one channel for a from-scratch network on grayscale
        transform = ImageTransform(image_size, channels=backbone.channels)
        if trial_group is not None:
            num_trainers, bundle = trial_bundles(trial_group)
            cpus_per_trainer = bundle.get("CPU", 1.0)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if num_trainers is None:
            num_trainers = gpus if gpus else default_count(cpus_per_trainer)
        if num_trainers < 1:
            raise FedrayError(f"need at least one trainer, got {num_trainers}")
        bounds = balanced_bounds(federation.client_offsets, num_trainers)
        trainers = len(bounds) - 1
        if trial_group is None:
            bundle = {"CPU": cpus_per_trainer, **({"GPU": gpu_share(gpus, num_trainers)} if gpus else {})}
        test_bounds = np.linspace(0, federation.test.num_rows, trainers + 1).astype(np.int64)
        rows = [Held.put(TrainerRows.of(federation, (int(bounds[t]), int(bounds[t + 1])), (int(test_bounds[t]), int(test_bounds[t + 1]))))
                for t in range(trainers)]
        state_budget = default_budget(cpus_per_trainer) if state_budget is None else state_budget
        arguments = [(backbone, federation.num_classes, transform, eval_batch_size, max(1, int(cpus_per_trainer)),
                      state_budget)] * trainers
        return cls.launch(Trainer, bundle, arguments, bounds, what=f"{trainers} trainers × {bundle}",
                          hint="lower num_trainers or cpus_per_trainer", trial_group=trial_group,
                          ready=lambda actors: fetch([actor.describe.remote() for actor in actors]),
                          federation=federation, backbone=backbone, image_size=image_size, rows=rows)

    @property
    def num_trainers(self) -> int:
        return len(self.actors)

    def train(self, training: ray.ObjectRef, received: ray.ObjectRef, clients: np.ndarray, round_number: int,
              steps: np.ndarray | None = None) -> RoundUpdate:
        """One round of local training of ``clients`` on their trainers (``steps``: each client's step budget, None:
        none), summed in the tree with one client a leaf: the same bits on any number of trainers."""
        owners = self.owners(clients)
        partials = [(actor.train.remote(held, training, received, clients[owners == index], round_number,
                                        None if steps is None else steps[owners == index]), actor)
                    for index, (actor, held) in enumerate(zip(self.actors, self.rows))]
        return tree_reduce(None, partials, merge_with(operator.add),
                           finish=root_of(self.federation.num_clients, operator.add)).result(fetch)

    def accuracy(self, params: ray.ObjectRef) -> float:
        if self.federation.test.num_rows == 0:
            raise FedrayError(f"{self.federation.name}: no test samples to evaluate on")
        counts = fetch([actor.correct.remote(held, params) for actor, held in zip(self.actors, self.rows)])
        return sum(correct for correct, _ in counts) / sum(total for _, total in counts)

    def embed(self, params: ray.ObjectRef, split: str) -> tuple[torch.Tensor, np.ndarray]:
        if split not in (TRAIN, TEST):
            raise FedrayError(f"unknown split {split!r}; use {TRAIN} or {TEST}")
        parts = fetch([actor.embed.remote(held, params, split) for actor, held in zip(self.actors, self.rows)])
        return torch.cat([features for features, _ in parts]), np.concatenate([labels for _, labels in parts])

    def entk(self, params: ray.ObjectRef, spec: EntkSpec, split: str) -> tuple[list[ray.ObjectRef], list[np.ndarray]]:
        """Each trainer's eNTK features of ``split`` as refs (left in the object store for the stage-2 shards) and its labels.

        Waits for all trainers: a trainer's error is raised here.
        """
        if split not in (TRAIN, TEST):
            raise FedrayError(f"unknown split {split!r}; use {TRAIN} or {TEST}")
        calls = [actor.entk.remote(held, params, spec, split) for actor, held in zip(self.actors, self.rows)]
        return [features for features, _ in calls], fetch([labels for _, labels in calls])
