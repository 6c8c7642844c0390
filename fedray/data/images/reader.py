"""A trainer's images: decoded on demand by a thread pool, one batch ahead of the model.

Images are decoded with the extraction code (:func:`~fedray.data.images.decode.load_image`,
the ImageNet evaluation transform), so a frozen backbone sees exactly the
inputs its cached features were computed from. Within one pass (a client's
loss evaluation and all its local epochs) decoded images are kept when the
pass's images fit in :data:`PASS_CACHE_BYTES`, so each is decoded once per
participation; larger clients are decoded again every epoch instead of
holding gigabytes (a 224-pixel image is 0.6 MB as float32).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from fedray.core.errors import FedrayError
from fedray.data.images.decode import ImageTransform, load_image

PASS_CACHE_BYTES = 1 << 30


class ImageReader:
    """Decodes images named by their row in ``paths``."""

    def __init__(self, paths: list[str | None], transform: ImageTransform, threads: int) -> None:
        self.paths = paths
        self.transform, self.pipeline = transform, transform.pipeline()
        self.decoders = ThreadPoolExecutor(max_workers=threads)
        self.image_bytes = transform.channels * transform.size**2 * 4

    def _decode(self, row: int) -> torch.Tensor | str:
        return load_image(self.paths[row], self.transform, self.pipeline)

    def _result(self, row: int, future: Future) -> torch.Tensor:
        image = future.result()
        if isinstance(image, str):
            raise FedrayError(f"{self.paths[row]}: {image} image (cannot fine-tune on it)")
        return image

    def batches(self, batches: list[np.ndarray]) -> Iterator[torch.Tensor]:
        """The stacked images of each batch of rows, in order; the next batch decodes while the caller works."""
        rows = np.unique(np.concatenate(batches)) if batches else np.zeros(0, np.int64)
        keep = len(rows) * self.image_bytes <= PASS_CACHE_BYTES
        cache: dict[int, torch.Tensor] = {}
        pending: dict[int, Future] = {}

        def submit(batch: np.ndarray) -> None:
            for row in batch.tolist():
                if row not in cache and row not in pending:
                    pending[row] = self.decoders.submit(self._decode, row)

        def take(row: int) -> torch.Tensor:
            if row in cache:
                return cache[row]
            image = self._result(row, pending.pop(row))
            if keep:
                cache[row] = image
            return image

        if batches:
            submit(batches[0])
        for index, batch in enumerate(batches):
            images = [take(row) for row in batch.tolist()]
            if index + 1 < len(batches):
                submit(batches[index + 1])
            yield torch.stack(images)
