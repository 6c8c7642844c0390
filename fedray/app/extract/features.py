"""``fedray extract``: a dataset's images → a feature cache, once.

A second run with the same key does no model work (it does not even start
Ray); a run interrupted half-way resumes from the parts that were finished.
"""

from __future__ import annotations

import sys
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray
from tqdm import tqdm

from fedray.data.feature_cache import CacheEntry, features_table, part_rows
from fedray.core.federation import TEST, TRAIN
from fedray.data.registry import canonical_spec, load_federation
from fedray.core.errors import FedrayError
from fedray.app.extract.config import ExtractConfig
from fedray.app.extract.pool import ExtractionPool
from fedray.data.images.backbones import forward_macs, get_backbone, load_weights
from fedray.data.images.decode import ImageTransform
from fedray.runtime.session import check_address, init_ray
from fedray.core.writable import check_folder

CACHE_FORMAT = 1


@dataclass
class ExtractReport:
    entry: str
    cache_hit: bool
    parts_computed: int
    parts_reused: int
    images_computed: int
    extract_s: float
    images_per_s: float | None
    skipped: dict[str, int]
    pretrained: bool
    workers: list[dict]


def extract(config: ExtractConfig, address: str | None = None) -> ExtractReport:
    config.validate()
    check_address(address)
    backbone = get_backbone(config.backbone)
    transform = ImageTransform(config.image_size, config.resize, config.grayscale)
    if backbone.fixed_size is not None and transform.size != backbone.fixed_size:
        raise FedrayError(f"{backbone.name} takes {backbone.fixed_size}-pixel images, got --image-size {transform.size}")
    weights = load_weights(backbone, config.weights, config.seed)
    key = {
        "format": CACHE_FORMAT,
        "dataset": canonical_spec(config.dataset),
        "backbone": backbone.name,
        "weights": weights.weights_id,
        "transform": transform.key(),
        "precision": config.precision,
    }
    entry = CacheEntry.for_key(Path(config.out), key)
    if entry.complete:
        manifest = entry.manifest()
        return ExtractReport(str(entry.path), True, 0, manifest["parts"], 0, 0.0, None, manifest["skipped"],
                             manifest["pretrained"], manifest["workers"])

    check_folder(Path(config.out))  # only now: a cache hit writes nothing, so a read-only cache serves it
    federation = load_federation(config.dataset)
    if "image_path" not in federation.table.column_names:
        raise FedrayError(f"{config.dataset}: no images to extract from (an hsu: split needs images=ROOT)")
    if config.on_bad_image == "fail" and federation.table.column("image_path").null_count:
        missing = federation.table.filter(federation.table.column("image_path").is_null())
        image_id = missing.column("image_id")[0].as_py()
        raise FedrayError(f"{config.dataset}: image {image_id!r} not found under the image root")
    entry.start(key)
    parts = [
        (split, index, rows) for split in (TRAIN, TEST) for index, rows in enumerate(part_rows(federation.table, split))
    ]
    entry.remove_stale_temporaries([entry.part_path(split, index).name for split, index, _ in parts])
    todo = deque(part for part in parts if not entry.part_path(part[0], part[1]).is_file())
    computed = len(todo)

    workers, images, seconds = [], 0, 0.0
    if todo:
        init_ray(address)
        pool = ExtractionPool.start(
            backbone, weights.state_dict, transform, precision=config.precision, batch_size=config.batch_size,
            pool_size=config.pool_size, cpus_per_worker=config.cpus_per_worker, device=config.device,
        )
        workers = pool.workers
        try:
            started = time.perf_counter()
            images = _run_parts(pool, todo, entry, federation.num_classes, config)
            seconds = time.perf_counter() - started
        finally:
            pool.shutdown()
    skipped = dict(sorted(Counter(reason for _, reason in entry.skipped()).items()))
    manifest = {
        "key": key,
        "dim": backbone.dim,
        "backbone_macs": forward_macs(backbone, transform.size),
        "num_classes": federation.num_classes,
        "rows": {split: sum(rows.num_rows for s, _, rows in parts if s == split) for split in (TRAIN, TEST)},
        "parts": len(parts),
        "skipped": skipped,
        "pretrained": weights.pretrained,
        "workers": workers,
    }
    entry.finish(manifest)
    return ExtractReport(str(entry.path), False, computed, len(parts) - computed, images, seconds,
                         images / seconds if seconds > 0 else None, skipped, weights.pretrained, workers)


def _run_parts(pool: ExtractionPool, todo: deque, entry: CacheEntry, num_classes: int, config: ExtractConfig) -> int:
    """Keep every replica two parts deep; write each part as it finishes. Returns the number of images read."""
    in_flight: dict[ray.ObjectRef, tuple[int, str, int, pa.Table]] = {}
    total, images = sum(rows.num_rows for *_, rows in todo), 0

    def submit(replica: int) -> None:
        if todo:
            split, index, rows = todo.popleft()
            paths = rows.column("image_path").to_pylist()
            ref = pool.extract(replica, rows.column("sample_id").to_numpy(), paths)
            in_flight[ref] = (replica, split, index, rows)

    for replica in range(len(pool.actors)):
        submit(replica)
        submit(replica)
    with tqdm(total=total, unit="img", desc="extract", disable=config.quiet, file=sys.stderr) as bar:
        while in_flight:
            [done], _ = ray.wait(list(in_flight), num_returns=1)
            replica, split, index, rows = in_flight.pop(done)
            try:
                result = ray.get(done)
            except ray.exceptions.RayError as error:
                raise FedrayError(f"extraction of {split} part {index} failed: {str(error).splitlines()[0]}") from None
            if result.skipped and config.on_bad_image == "fail":
                sample_id, reason = result.skipped[0]
                row = int(np.searchsorted(rows.column("sample_id").to_numpy(), sample_id))
                path = rows.column("image_path")[row].as_py()
                raise FedrayError(f"{path}: {reason} image (sample {sample_id}); use --on-bad-image skip to skip such images")
            table = features_table(result.sample_ids, rows, result.features)
            entry.write_part(split, index, table, num_classes, result.skipped)
            images += rows.num_rows
            bar.update(rows.num_rows)
            submit(replica)
    return images
