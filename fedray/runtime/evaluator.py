"""The accuracy of a classifier on the federation's test rows, which the shards hold (see :mod:`fedray.evaluation`)."""

from __future__ import annotations

import ray

from fedray.evaluation import FeatureMap
from fedray.methods.base import Classifier
from fedray.runtime.shards import ShardPool


class Evaluator:
    """Counts correct predictions in the shards and adds them: the driver never holds the test features.

    A feature map goes to the object store once (while it is the one being
    evaluated), and each shard transforms its test rows through it once.
    """

    def __init__(self, pool: ShardPool) -> None:
        self.pool = pool
        self.num_rows = pool.federation.test.num_rows
        self._feature_map: tuple[FeatureMap, ray.ObjectRef] | None = None

    def accuracy(self, feature_map: FeatureMap, classifier: Classifier) -> float:
        if self.num_rows == 0:
            return float("nan")
        if self._feature_map is None or self._feature_map[0] is not feature_map:
            self._feature_map = (feature_map, ray.put(feature_map))
        return self.pool.correct(self._feature_map[1], ray.put(classifier)) / self.num_rows
