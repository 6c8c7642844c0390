"""A calibration after training: a closed form on the features at the trained parameters replaces the classifier.

SphereFed's: clients send ZᵀZ and ZᵀY once, Z = normalize(P x + q) of their
samples; the server's ridge solution replaces the fixed classifier. It runs
through the same shards as training (the projection is part of the method's
feature map), as one round with every client; ``--calibrate METHOD`` runs any
closed-form method the same way.
"""

from __future__ import annotations

import numpy as np
import torch

from fedray.engine.closed_form import everyone_uploads
from fedray.runtime.evaluator import Evaluator
from fedray.methods.base import Classifier, ClosedFormMethod
from fedray.methods.postprocessor import Postprocessing
from fedray.methods.ridge import FastFederatedCalibration
from fedray.runtime.shards import ShardPool


class ProjectedCalibration(FastFederatedCalibration):
    """FFC on normalize(P x + q) (l dimensions) of features of ``dim`` dimensions."""

    def __init__(self, dim: int, num_classes: int, lam: float, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__(dim, num_classes, lam=lam)
        self.weight, self.bias_vector = weight, bias

    @property
    def feature_dim(self) -> int:
        return self.weight.shape[0]

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        """In float64, so the statistics are those of the exact normalized features, whatever the shard's rows."""
        projected = features.double() @ self.weight.double().T + self.bias_vector.double()
        return torch.nn.functional.normalize(projected, dim=1)

    def statistics_flops(self, sizes: np.ndarray) -> np.ndarray:
        return super().statistics_flops(sizes) + 2.0 * sizes * self.dim * self.feature_dim


def calibrate(pool: ShardPool, evaluator: Evaluator, method: ClosedFormMethod, postprocessing: Postprocessing,
              round_number: int) -> tuple[Classifier, float]:
    """The classifier ``method`` solves from every client's upload (in round ``round_number``, through
    ``postprocessing``) on the pool's features, and its test accuracy."""
    statistics = everyone_uploads(pool, method, postprocessing, round_number)
    classifier = method.solve(statistics)
    return classifier, evaluator.accuracy(method, classifier)
