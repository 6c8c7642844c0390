"""A shard's evaluation job: correct predictions on the whole chunks of test rows the shard holds
(:mod:`fedray.methods.evaluation`), so the driver never holds test features."""

from __future__ import annotations

import numpy as np
import ray
import torch

from fedray.methods.base import Classifier
from fedray.methods.evaluation import EvalRows


class ShardEvaluation:
    """Counts a classifier's correct predictions on a shard's test rows."""

    def __init__(self, features: torch.Tensor, labels: np.ndarray) -> None:
        self.test = EvalRows(features, torch.from_numpy(labels.astype(np.int64)))

    def correct(self, feature_map: list[ray.ObjectRef], classifier: Classifier) -> int:
        """Correct predictions of ``classifier`` on the test rows through ``feature_map[0]`` (a reference, in a list so
        that Ray passes it unresolved: it is fetched only when the shard has not transformed through it)."""
        return self.test.correct(feature_map[0].hex(), lambda: ray.get(feature_map[0]), classifier)
