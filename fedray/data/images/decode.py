"""Reading one image and turning it into the network's input, as the papers' code does.

The evaluation transform of torchvision's ImageNet recipe: resize the short
side to ``resize`` (256 for a 224 crop), center-crop ``size``, scale to [0, 1]
and normalize with the ImageNet mean and std. Images that cannot be used are
not errors here: :func:`load_image` names why, and the caller counts, reports
and skips them (or stops, by the ``on_bad_image`` policy).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from PIL import Image, UnidentifiedImageError
from torchvision.transforms import v2

from fedray.core.errors import FedrayError
from fedray.data.images import GRAYSCALE_POLICIES

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
GRAYSCALE_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"})
MISSING, UNREADABLE, GRAYSCALE = "missing", "unreadable", "grayscale"


@dataclass(frozen=True)
class ImageTransform:
    """The input pipeline; every field changes the features, so all are part of the cache key.

    ``grayscale``: ``convert`` replicates the single channel to RGB; ``skip``
    drops grayscale images (what the Fed3R code does on iNaturalist).
    """

    size: int = 224
    resize: int | None = None
    grayscale: str = "convert"
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        if self.size < 16:
            raise FedrayError(f"--image-size must be ≥ 16, got {self.size}")
        if self.resize is not None and self.resize < self.size:
            raise FedrayError(f"--resize ({self.resize}) must be ≥ --image-size ({self.size})")
        if self.grayscale not in GRAYSCALE_POLICIES:
            raise FedrayError(f"--grayscale must be one of {', '.join(GRAYSCALE_POLICIES)}, got {self.grayscale!r}")

    @property
    def resize_to(self) -> int:
        """Short-side size before the crop: the 256/224 ratio of the ImageNet recipe unless given."""
        return self.resize if self.resize is not None else round(self.size * 256 / 224)

    def key(self) -> dict:
        return {**asdict(self), "resize": self.resize_to}

    def pipeline(self) -> v2.Compose:
        return v2.Compose(
            [
                v2.Resize(self.resize_to, antialias=True),
                v2.CenterCrop(self.size),
                v2.ToImage(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(self.mean, self.std),
            ]
        )


def load_image(path: str | None, transform: ImageTransform, pipeline: v2.Compose) -> torch.Tensor | str:
    """The (3, size, size) input tensor of the image at ``path``, or why it cannot be used."""
    if path is None:
        return MISSING
    try:
        with Image.open(path) as image:
            if image.mode in GRAYSCALE_MODES and transform.grayscale == "skip":
                return GRAYSCALE
            rgb = image.convert("RGB")
    except FileNotFoundError:
        return MISSING
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return UNREADABLE
    return pipeline(rgb)
