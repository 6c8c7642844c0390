"""Reading one image and turning it into the network's input, as the papers' code does.

The evaluation transform of torchvision's ImageNet recipe: resize the short
side to ``resize`` (256 for a 224 crop), center-crop ``size``, scale to [0, 1]
and normalize with the ImageNet mean and std. A network trained from scratch on
grayscale images (``channels`` 1, see :func:`grayscale_images`) gets them with
one channel, normalized with the ImageNet mean and std averaged over the three
channels; every other network gets RGB. Images that cannot be used are
not errors here: :func:`load_image` names why, and the caller counts, reports
and skips them (or stops, by the ``on_bad_image`` policy).
"""

from __future__ import annotations

from collections.abc import Sequence
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
GRAYSCALE_PROBES = 64
"""Images whose modes :func:`grayscale_images` reads (their headers only), evenly spread over a dataset's."""


def grayscale_images(paths: Sequence[str | None], probes: int = GRAYSCALE_PROBES) -> bool:
    """Whether the images at ``paths`` are a grayscale dataset (MNIST, FMNIST): ``probes`` of them, evenly spread
    (all when fewer), read and each of a grayscale mode. One color image among them makes it RGB; one that cannot be
    read is passed over (decoding it later says why)."""
    count, probed = len(paths), min(probes, len(paths))
    rows = sorted({round(i * (count - 1) / max(probed - 1, 1)) for i in range(probed)})
    modes = []
    for path in (paths[row] for row in rows if paths[row] is not None):
        try:
            with Image.open(path) as image:
                modes.append(image.mode)
        except (OSError, ValueError, Image.DecompressionBombError):
            continue
    return bool(modes) and all(mode in GRAYSCALE_MODES for mode in modes)


@dataclass(frozen=True)
class ImageTransform:
    """The input pipeline; every field changes the features, so all are part of the cache key.

    ``grayscale``: ``convert`` replicates the single channel to RGB; ``skip``
    drops grayscale images (what the Fed3R code does on iNaturalist).
    ``channels``: 3 (RGB), or 1 for a network trained from scratch on a grayscale
    dataset (every image converted to PIL's luminance ``L``).
    """

    size: int = 224
    resize: int | None = None
    grayscale: str = "convert"
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    channels: int = 3

    def __post_init__(self) -> None:
        if self.channels not in (1, 3):
            raise FedrayError(f"images have 1 or 3 channels, got {self.channels}")
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
        key = {**asdict(self), "resize": self.resize_to}
        if self.channels == 3:  # the key of every RGB feature cache, as written before the field was
            del key["channels"]
        return key

    def normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(mean, std) per channel: ``mean`` and ``std``, or with one channel their averages."""
        if self.channels == 1:
            return (sum(self.mean) / 3,), (sum(self.std) / 3,)
        return self.mean, self.std

    def pipeline(self) -> v2.Compose:
        return v2.Compose(
            [
                v2.Resize(self.resize_to, antialias=True),
                v2.CenterCrop(self.size),
                v2.ToImage(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(*self.normalization()),
            ]
        )


def load_image(path: str | None, transform: ImageTransform, pipeline: v2.Compose) -> torch.Tensor | str:
    """The (channels, size, size) input tensor of the image at ``path``, or why it cannot be used."""
    if path is None:
        return MISSING
    try:
        with Image.open(path) as image:
            if image.mode in GRAYSCALE_MODES and transform.grayscale == "skip":
                return GRAYSCALE
            converted = image.convert("L" if transform.channels == 1 else "RGB")
    except FileNotFoundError:
        return MISSING
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return UNREADABLE
    return pipeline(converted)
