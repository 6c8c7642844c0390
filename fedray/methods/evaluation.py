"""Accuracy on the federation's test rows, counted where the rows are: each shard holds whole chunks of them.

The test rows are cut into chunks of :data:`CHUNK` rows and each shard holds a
run of whole chunks (:func:`eval_bounds`), so every layout of shards computes
the same chunk GEMMs, bit for bit, and counts the same correct predictions;
the driver only adds the counts (:class:`fedray.runtime.evaluator.Evaluator`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from fedray.methods.base import Classifier

CHUNK = 8192
"""Test rows per evaluation GEMM."""


class FeatureMap(Protocol):
    """What a classifier is evaluated on: a method's feature map (identity for most; Fed3R's random features)."""

    def transform(self, features: torch.Tensor) -> torch.Tensor: ...


def eval_bounds(num_rows: int, num_shards: int) -> np.ndarray:
    """Test-row positions where shards start (plus ``num_rows`` at the end): whole chunks, balanced by chunk count."""
    chunks = -(-num_rows // CHUNK)
    cuts = np.floor(np.arange(num_shards + 1) * chunks / num_shards).astype(np.int64) * CHUNK
    return np.minimum(cuts, num_rows)


def predictions(scores: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first of equal maxima; through numpy on the CPU, where torch's argmax along rows is
    slow (8,192 × 1,203 float32 scores, one thread: torch 21 ms, numpy 1.7 ms, beside the chunk's GEMM's 130 ms)."""
    if scores.device.type == "cpu":
        return torch.from_numpy(scores.numpy().argmax(1))
    return scores.argmax(1)


class EvalRows:
    """A shard's test rows, their features through the last feature map evaluated (kept until another comes), and one
    chunk's scores (kept: written into anew by every chunk GEMM, rather than faulting in fresh pages each time)."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.features, self.labels = features, labels
        self._inputs: tuple[str, list[torch.Tensor]] | None = None
        self._scores = torch.empty(0)

    def _scores_for(self, rows: int, classes: int) -> torch.Tensor:
        if self._scores.shape[1:] != (classes,) or len(self._scores) < rows:
            self._scores = torch.empty(min(len(self.features), CHUNK), classes)
        return self._scores[:rows]

    def correct(self, key: str, feature_map: Callable[[], FeatureMap], classifier: Classifier) -> int:
        """Correct predictions of ``classifier`` on the rows through the feature map named ``key`` (fetched by
        ``feature_map`` when it is not the one kept), one float32 GEMM a chunk."""
        if self._inputs is None or self._inputs[0] != key:
            self._inputs = None  # free the last map's output before the new one is computed: one at a time in memory
            transform = feature_map().transform
            self._inputs = (key, [transform(chunk).to(torch.float32) for chunk in self.features.split(CHUNK)])
        weight = classifier.weight.to(torch.float32)
        bias = None if classifier.bias is None else classifier.bias.to(torch.float32)
        correct = 0
        for inputs, labels in zip(self._inputs[1], self.labels.split(CHUNK)):
            scores = torch.matmul(inputs, weight, out=self._scores_for(len(inputs), weight.shape[1]))
            if bias is not None:
                scores += bias
            correct += int((predictions(scores) == labels).sum())
        return correct
