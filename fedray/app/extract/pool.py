"""The extraction pool: model replicas in a placement group, one bundle per GPU (or CPU slot).

Each replica is a long-lived actor that, per call, reads and decodes one part
of the dataset (a fixed block of images) with a thread pool while the model
runs on the previous batch, and returns the part's features. The driver keeps
every replica two parts deep, so a replica never waits for work, and writes
each finished part to the cache as it arrives.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup, remove_placement_group

from fedray.core.errors import FedrayError
from fedray.data.images.backbones import Backbone, feature_model
from fedray.data.images.decode import ImageTransform, load_image
from fedray.runtime.held import Held
from fedray.runtime.placement import gpu_share, reserve, start_actors
from fedray.methods.training.images import ieee_float32

AUTOCAST_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PartResult:
    """What a replica returns for one part: the features of the usable images and why the others were skipped."""

    sample_ids: np.ndarray
    features: np.ndarray
    skipped: list[tuple[int, str]]


@ray.remote(max_restarts=2, max_task_retries=2)
class Extractor:
    """One model replica. A call is a pure function of its arguments, so Ray can retry it on a restarted replica.

    The weights come with every call, as a :class:`Held` state dict (see
    :mod:`fedray.runtime.held`); the model is built on the first call.
    """

    def __init__(self, backbone: Backbone, transform: ImageTransform, precision: str, batch_size: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.backbone, self.weights, self.model = backbone, None, None
        self.dim = backbone.dim
        self.transform, self.pipeline = transform, transform.pipeline()
        self.dtype = AUTOCAST_DTYPES[precision]
        if self.device.type == "cuda" and self.dtype is None:
            ieee_float32()  # fp32 features are float32's, not TF32's
        self.batch_size = batch_size
        self.decoders = ThreadPoolExecutor(max_workers=threads)

    def describe(self) -> dict:
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "device": str(self.device)}

    def _decode(self, paths: list[str | None]) -> list[Future]:
        return [self.decoders.submit(load_image, path, self.transform, self.pipeline) for path in paths]

    @torch.inference_mode()
    def _embed(self, images: list[torch.Tensor]) -> np.ndarray:
        batch = torch.stack(images).to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            features = self.model(batch)
        return features.float().cpu().numpy()

    def extract(self, weights: Held, sample_ids: np.ndarray, paths: list[str | None]) -> PartResult:
        if self.weights != weights:
            self.model, self.weights = feature_model(self.backbone, weights.get()).to(self.device), weights
        starts = range(0, len(paths), self.batch_size)
        pending = self._decode(paths[: self.batch_size])
        kept, features, skipped = [], [], []
        for start in starts:
            decoded = [future.result() for future in pending]
            following = start + self.batch_size
            pending = self._decode(paths[following : following + self.batch_size])
            images = []
            for sample_id, item in zip(sample_ids[start:following], decoded):
                if isinstance(item, str):
                    skipped.append((int(sample_id), item))
                else:
                    kept.append(int(sample_id))
                    images.append(item)
            if images:
                features.append(self._embed(images))
        stacked = np.concatenate(features) if features else np.zeros((0, self.dim), np.float32)
        return PartResult(np.array(kept, np.int64), stacked, skipped)


@dataclass
class ExtractionPool:
    """The replicas, their placement group, where each runs, and the weights (sent with every call: a restarted
    replica needs them again)."""

    actors: list
    group: PlacementGroup
    workers: list[dict]
    weights: Held

    @classmethod
    def start(
        cls,
        backbone: Backbone,
        state_dict: dict,
        transform: ImageTransform,
        *,
        precision: str = "fp32",
        batch_size: int = 64,
        pool_size: int | None = None,
        cpus_per_worker: float = 1,
        device: str = "auto",
    ) -> "ExtractionPool":
        """Reserve one bundle per replica (GPU when the cluster has them and ``device`` allows) and start the replicas.

        Options are those of a validated :class:`~fedray.app.extract.config.ExtractConfig`.
        """
        gpus = int(ray.cluster_resources().get("GPU", 0))
        use_gpus = device == "cuda" or (device == "auto" and gpus > 0)
        if pool_size is None:
            pool_size = gpus if use_gpus else int(ray.cluster_resources().get("CPU", 1) // cpus_per_worker)
        if pool_size < 1:
            raise FedrayError("no extraction replica fits: " + ("the cluster has no GPU" if use_gpus else "too few CPUs"))
        bundle = {"CPU": cpus_per_worker, **({"GPU": gpu_share(gpus, pool_size)} if use_gpus else {})}
        group = reserve(
            bundle, pool_size, "SPREAD", f"{pool_size} extraction replicas × {bundle}", "lower --pool-size or --cpus-per-worker"
        )
        arguments = (backbone, transform, precision, batch_size, max(1, int(cpus_per_worker)))
        actors = start_actors(Extractor, group, bundle, [arguments] * pool_size)
        workers = ray.get([actor.describe.remote() for actor in actors])
        return cls(actors, group, workers, Held.put(state_dict))

    def extract(self, replica: int, sample_ids: np.ndarray, paths: list[str | None]) -> ray.ObjectRef:
        """Submit one part to replica ``replica``; its :class:`PartResult`'s ref."""
        return self.actors[replica].extract.remote(self.weights, sample_ids, paths)

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.group)
