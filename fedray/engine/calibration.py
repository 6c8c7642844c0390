"""SphereFed's calibration after training: FFC on the trained projection's (or backbone's) normalized features.

Clients send ZᵀZ and ZᵀY once, Z = normalize(P x + q) of their samples; the
server's ridge solution replaces the fixed classifier. It runs through the same
shards as training (the projection is part of the method's feature map), as
one round with every client.
"""

from __future__ import annotations

import numpy as np
import torch

from fedray.engine.closed_form import everyone_uploads
from fedray.runtime.evaluator import Evaluator
from fedray.methods.base import Classifier
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


def calibrate(pool: ShardPool, evaluator: Evaluator, lam: float, postprocessing: Postprocessing, round_number: int,
              weight: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> tuple[Classifier, float, FastFederatedCalibration]:
    """The calibrated classifier (l × C), its test accuracy and the method (for its traffic and FLOPs).

    FFC on normalize(P x + q) with a trained projection (``weight`` P, ``bias`` q), or on normalize(x) without one;
    every client's upload, in round ``round_number``, through ``postprocessing``.
    """
    federation = pool.federation
    if weight is None:
        method = FastFederatedCalibration(federation.dim, federation.num_classes, lam=lam)
    else:
        method = ProjectedCalibration(federation.dim, federation.num_classes, lam, weight, bias)
    statistics = everyone_uploads(pool, method, postprocessing, round_number)
    classifier = method.solve(statistics)
    return classifier, evaluator.accuracy(method, classifier), method
