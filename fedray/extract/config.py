"""What ``fedray extract`` is asked to do (kept free of heavy imports: the CLI reads its defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExtractConfig:
    dataset: str
    backbone: str = "mobilenet_v2"
    weights: str = "imagenet"
    out: str = "cache/features"
    image_size: int = 224
    resize: int | None = None
    grayscale: str = "convert"
    on_bad_image: str = "skip"
    precision: str = "fp32"
    batch_size: int = 64
    pool_size: int | None = None
    cpus_per_worker: float = 1.0
    device: str = "auto"
    seed: int = 0
    quiet: bool = False
