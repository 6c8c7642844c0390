"""SphereFed's fixed classifier: C unit-norm rows in R^d, built once from the run's seed and never trained; its scores and loss.

With C ≤ d the rows are orthonormal: the Q factor of a seeded Gaussian d × C
matrix, transposed. With C > d no C rows can be orthogonal; the best one can
do for all pairs at once is an equal-norm tight frame (unit rows, WᵀW = (C/d) I),
which minimizes Σ_{i≠j} ⟨w_i, w_j⟩² (the frame potential, whose lower bound
C²/d − C is the Welch bound). It is reached by alternating projections from
the same seeded start: scale the columns to a tight frame (the polar factor of
W, times √(C/d)), then the rows to unit norm, until both hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import numpy as np

from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.core.numeric_options import check_positive
from fedray.core.options import Unset
from fedray.methods.ridge import FastFederatedCalibration

torch = lazy_module("torch", globals())

TIGHT_FRAME_TOLERANCE = 1e-10
MAX_ITERATIONS = 10_000


def fixed_classifier(num_classes: int, dim: int, seed: int) -> torch.Tensor:
    """The (C, d) float64 classifier: orthonormal rows if C ≤ d, else a unit-norm tight frame."""
    if num_classes < 1 or dim < 1:
        raise FedrayError(f"a fixed classifier needs C ≥ 1 and d ≥ 1, got C={num_classes}, d={dim}")
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(dim, num_classes, generator=generator, dtype=torch.float64)
    if num_classes <= dim:
        q, r = torch.linalg.qr(start)
        return (q * torch.sign(torch.diagonal(r))).T.contiguous()
    rows = start.T
    scale = math.sqrt(num_classes / dim)
    for _ in range(MAX_ITERATIONS):
        u, _, vh = torch.linalg.svd(rows, full_matrices=False)
        rows = torch.nn.functional.normalize(scale * u @ vh, dim=1)
        if torch.linalg.matrix_norm(rows.T @ rows - scale**2 * torch.eye(dim, dtype=torch.float64)) < TIGHT_FRAME_TOLERANCE * num_classes:
            break
    return rows.contiguous()


def sphere_logits(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, classifier: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(features @ weight.T + bias, dim=1) @ classifier.T


@dataclass(frozen=True)
class SphereHead:
    """SphereFed's head (``--head sphere``): an l × d projection onto the sphere before the fixed classifier, trained
    with its loss, then calibrated by FFC."""

    calibration_method: ClassVar[str] = "ffc"
    """The closed form that calibrates SphereFed's head after training."""

    sphere_dim: Annotated[int | None, "dimension l of the sphere", Unset("the feature dim")] = None
    sphere_loss: Annotated[Literal["mse", "ce"], "mse (SphereFed's) or ce at --temperature"] = "mse"

    def __post_init__(self) -> None:
        check_positive({"sphere_dim": self.sphere_dim})
        if self.sphere_loss not in ("mse", "ce"):
            raise FedrayError(f"--sphere-loss must be mse or ce, got {self.sphere_loss!r}")

    def width(self, feature_dim: int) -> int:
        """l: the projection's width on features of ``feature_dim`` dimensions (theirs unless ``sphere_dim`` says)."""
        return self.sphere_dim or feature_dim


def sphere_loss(logits: torch.Tensor, labels: torch.Tensor, loss: str, temperature: float) -> torch.Tensor:
    """Mean over the batch of SphereFed's (1/C)‖Wz − onehot(y)‖², or of the cross-entropy of Wz / T."""
    if loss == "ce":
        return torch.nn.functional.cross_entropy(logits / temperature, labels)
    one_hot = torch.nn.functional.one_hot(labels, logits.shape[1]).to(logits.dtype)
    return ((logits - one_hot) ** 2).mean(dim=1).mean()


class ProjectedCalibration(FastFederatedCalibration):
    """FFC on normalize(P x + q) (l dimensions) of features of ``dim`` dimensions: SphereFed's calibration of a
    projection trained on the features themselves (the projection is part of the method's feature map)."""

    def __init__(self, dim: int, num_classes: int, lam: float, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__(dim, num_classes, lam=lam)
        self.weight, self.bias_vector = weight, bias

    @classmethod
    def around(cls, calibration: FastFederatedCalibration, weight: torch.Tensor,
               bias: torch.Tensor) -> ProjectedCalibration:
        """``calibration`` (its λ) on normalize(P x + q), P = ``weight`` and q = ``bias``."""
        return cls(calibration.dim, calibration.num_classes, calibration.lam, weight, bias)

    @property
    def feature_dim(self) -> int:
        return self.weight.shape[0]

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        """In float64, so the statistics are those of the exact normalized features, whatever the shard's rows."""
        projected = features.double() @ self.weight.double().T + self.bias_vector.double()
        return torch.nn.functional.normalize(projected, dim=1)

    def statistics_flops(self, sizes: np.ndarray) -> np.ndarray:
        return super().statistics_flops(sizes) + 2.0 * sizes * self.dim * self.feature_dim
