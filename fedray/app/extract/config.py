"""What ``fedray extract`` is asked to do (kept free of heavy imports: the CLI reads its defaults)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from fedray.core.errors import FedrayError
from fedray.data.images import GRAYSCALE_POLICIES
from fedray.core.numeric_options import check_numeric_options, command_line

PRECISIONS = ("fp32", "fp16", "bf16")
DEVICES = ("auto", "cuda", "cpu")
BAD_IMAGE_POLICIES = ("skip", "fail")


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

    def validate(self) -> "ExtractConfig":
        """Every option checked before anything is loaded or written."""
        check_numeric_options({f.name: getattr(self, f.name) for f in fields(self)}, command_line)
        for option, value, allowed in (
            ("--precision", self.precision, PRECISIONS),
            ("--device", self.device, DEVICES),
            ("--grayscale", self.grayscale, GRAYSCALE_POLICIES),
            ("--on-bad-image", self.on_bad_image, BAD_IMAGE_POLICIES),
        ):
            if value not in allowed:
                raise FedrayError(f"{option} must be one of {', '.join(allowed)}, got {value!r}")
        for option, value, minimum in (("--batch-size", self.batch_size, 1), ("--pool-size", self.pool_size, 1)):
            if value is not None and value < minimum:
                raise FedrayError(f"{option} must be ≥ {minimum}, got {value}")
        if self.cpus_per_worker <= 0:
            raise FedrayError(f"--cpus-per-worker must be > 0, got {self.cpus_per_worker}")
        return self
