"""Benchmark: the extraction pool against a bare ``torch.inference_mode()`` loop over the same batches.

    python -m jobs.bench_extract [--images 1024] [--backbone mobilenet_v2] [--batch-size 32] [--device auto|cuda|cpu]
                                 [--precision fp32|bf16|fp16] [--cpus-per-worker 1]

Writes ``--images`` seeded synthetic 400×300 JPEGs (an image folder), then, on
an embedded local Ray (or $RAY_ADDRESS), extracts their features with the
pool (one replica per CPU, or per GPU) and, in this same process, with a plain
loop that reads, decodes and transforms each batch of the same images with the
same code and runs the model on it, using all of this machine's cores, on the
pool's device (``--device``: CUDA when the pool's replicas have GPUs) and at its
``--precision`` (autocast, as the replicas do). Weights
are a seeded random initialization: the features are NOT pre-trained, which
changes nothing in the timing. Prints one JSON line: images/s of the pool
(first image sent to last part written; replica start-up reported apart), of
the bare loop, their ratio, the second run's (cache hit) time, the largest
difference between the two feature sets, the pool's largest difference from
float32 features (the bare loop's at fp32, relative to their largest magnitude;
0 at fp32), and peak memory. ``--cpus-per-worker`` sets each replica's decode
threads (a GPU replica with one decode thread is decode-bound).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fedray.data.feature_cache import CacheEntry
from fedray.data.registry import load_federation
from fedray.app.extract.config import DEVICES, PRECISIONS, ExtractConfig
from fedray.app.extract.pool import AUTOCAST_DTYPES
from fedray.app.extract.features import extract
from fedray.data.images.backbones import feature_model, get_backbone, load_weights
from fedray.data.images.decode import ImageTransform, load_image
from fedray.runtime.session import init_ray
from fedray.runtime.shards import peak_memory_bytes

MB = 2**20


def write_images(root: Path, count: int, seed: int) -> Path:
    """``count`` photo-sized JPEGs (smooth random content) in 10 class folders."""
    rng = np.random.default_rng(seed)
    for n in range(count):
        folder = root / "train" / f"class_{n % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        coarse = rng.integers(0, 256, size=(12, 16, 3), dtype=np.uint8)
        Image.fromarray(coarse).resize((400, 300), Image.BICUBIC).save(folder / f"{n:05d}.jpg", quality=90)
    return root


def bare_loop(config: ExtractConfig, paths: list[str], device: torch.device) -> tuple[float, np.ndarray]:
    """Seconds and features of a plain loop on ``device``: read + decode + transform a batch, then ``model(batch)``
    (under autocast at the run's precision, as a replica)."""
    torch.set_num_threads(os.cpu_count() or 1)
    backbone = get_backbone(config.backbone)
    model = feature_model(backbone, load_weights(backbone, config.weights, config.seed).state_dict).to(device)
    dtype = AUTOCAST_DTYPES[config.precision]
    transform = ImageTransform(config.image_size)
    pipeline = transform.pipeline()
    features = []
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(paths), config.batch_size):
            batch = torch.stack([load_image(p, transform, pipeline) for p in paths[first : first + config.batch_size]])
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                output = model(batch.to(device, non_blocking=True))
            features.append(output.float().cpu().numpy())
    return time.perf_counter() - start, np.concatenate(features)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--backbone", default="mobilenet_v2")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--device", choices=DEVICES, default="auto")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0,
                        help="decode threads (CPUs) per replica (default %(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedray-bench-extract-") as scratch:
        root = write_images(Path(scratch) / "images", args.images, seed=0)
        config = ExtractConfig(dataset=f"imagefolder:{root}", backbone=args.backbone, weights="random",
                               out=str(Path(scratch) / "cache"), image_size=args.image_size,
                               batch_size=args.batch_size, device=args.device, precision=args.precision,
                               cpus_per_worker=args.cpus_per_worker, quiet=True)
        ray_start_s = time.perf_counter()
        init_ray()
        ray_start_s = time.perf_counter() - ray_start_s
        pool_wall_s = time.perf_counter()
        report = extract(config)
        pool_wall_s = time.perf_counter() - pool_wall_s
        hit_s = time.perf_counter()
        second = extract(config)
        hit_s = time.perf_counter() - hit_s
        paths = load_federation(config.dataset).table.sort_by("sample_id").column("image_path").to_pylist()
        devices = sorted({w["device"] for w in report.workers})
        bare_s, bare = bare_loop(config, paths, torch.device("cuda" if "cuda" in devices else "cpu"))
        pool = CacheEntry(Path(report.entry)).features()
        # the reduced precision's distance from float32, on the same images and device
        fp32 = bare if args.precision == "fp32" else bare_loop(replace(config, precision="fp32"), paths,
                                                               torch.device("cuda" if "cuda" in devices else "cpu"))[1]
    pool_ips, bare_ips = args.images / report.extract_s, args.images / bare_s
    print(json.dumps({
        "benchmark": "extract_pool",
        "backbone": args.backbone,
        "weights": "random-seed0 (NOT pre-trained; timing only)",
        "images": args.images,
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "replicas": len(report.workers),
        "devices": devices,
        "precision": args.precision,
        "ray_start_s": round(ray_start_s, 2),
        "pool_start_s": round(pool_wall_s - report.extract_s, 2),
        "pool_s": round(report.extract_s, 2),
        "pool_images_per_s": round(pool_ips, 1),
        "bare_loop_s": round(bare_s, 2),
        "bare_images_per_s": round(bare_ips, 1),
        "ratio_pool_vs_bare": round(pool_ips / bare_ips, 3),
        "cache_hit": second.cache_hit,
        "cache_hit_s": round(hit_s, 3),
        "max_abs_diff_vs_bare": float(np.abs(pool - bare).max()),
        "max_rel_diff_vs_fp32": float(np.abs(pool - fp32).max() / np.abs(fp32).max()),
        "cpus_per_worker": args.cpus_per_worker,
        "peak_rss_driver_mb": peak_memory_bytes() // MB,
        "torch_threads_bare": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
