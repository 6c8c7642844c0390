"""The accuracy of a classifier on the federation's test rows, which the shards hold (see :mod:`fedray.methods.evaluation`)."""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch

from fedray.methods.evaluation import FeatureMap
from fedray.methods.base import Classifier
from fedray.runtime.shards import ShardPool


class Evaluator:
    """Counts correct predictions in the shards and adds them: the driver never holds the test features.

    A feature map goes to the object store once (while it is the one being
    evaluated), and each shard transforms its test rows through it once.
    """

    def __init__(self, pool: ShardPool) -> None:
        self.pool = pool
        self.num_rows = pool.federation.num_test
        self._feature_map: tuple[FeatureMap, ray.ObjectRef] | None = None

    def accuracy(self, feature_map: FeatureMap, classifier: Classifier) -> float:
        return self.submit(feature_map, classifier).result()

    def submit(self, feature_map: FeatureMap, classifier: Classifier) -> "PendingAccuracy":
        """Queue the evaluation in the shards and return at once, so the driver can go on (e.g. solve the next block)."""
        if self.num_rows == 0:
            return PendingAccuracy([], 0)
        if self._feature_map is None or self._feature_map[0] is not feature_map:
            self._feature_map = (feature_map, ray.put(feature_map))
        return PendingAccuracy(self.pool.correct(self._feature_map[1], ray.put(_as_scored(classifier))), self.num_rows)


def _as_scored(classifier: Classifier) -> Classifier:
    """``classifier`` in float32, as the shards score with it (:mod:`fedray.methods.evaluation`): half the bytes of a float64
    classifier through the object store, and the same scores."""
    bias = None if classifier.bias is None else classifier.bias.to(torch.float32)
    return Classifier(classifier.weight.to(torch.float32), bias)


@dataclass(frozen=True)
class PendingAccuracy:
    """An evaluation the shards are computing: their counts of correct predictions, out of ``num_rows``."""

    counts: list[ray.ObjectRef]
    num_rows: int

    def result(self) -> float:
        """The accuracy (NaN without test rows), waiting for the shards' counts."""
        return sum(ray.get(self.counts)) / self.num_rows if self.num_rows else float("nan")
