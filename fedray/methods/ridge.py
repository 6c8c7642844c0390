"""Fed3R and its relatives: ridge regression from summed ZᵀZ and ZᵀY.

Fed3R (Fani et al., ICML 2024) on the raw features, Fed3R-RF on random Fourier
features of an RBF kernel, and SphereFed's FFC calibration (Dong et al., ECCV
2022) on L2-normalized features without column normalization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import numpy as np

from fedray.core.accounting import PaperCosts
from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.core.options import Unset
from fedray.methods.base import (ClientBatch, Classifier, ClosedFormMethod, TorchDtype, class_sums,
                                 client_gram_triangles, column_norms, gram, HeldClasses, spd_solve)
from fedray.methods.row_blocks import rowwise_matmul
from fedray.methods.upload_parts import SampleSum, UploadParts

torch = lazy_module("torch", globals())

if TYPE_CHECKING:
    from fedray.core.federation import Federation


@dataclass
class RidgeStatistics:
    gram: torch.Tensor
    targets: torch.Tensor


PROBE_METHOD = "fed3r"
"""The closed form of --probe-ridge."""

RIDGE_SUMS = UploadParts({"gram": SampleSum(2, symmetric=True, width_axis=0),
                          "targets": SampleSum(1, width_axis=0, class_axis=1)})
"""ZᵀZ (p × p) and ZᵀY (p × C) over the design's rows (p: its width, the features' d for Fed3R without a bias)."""


class Fed3R(ClosedFormMethod[RidgeStatistics]):
    """W = (Σ ZᵀZ + λI)⁻¹ Σ ZᵀY in float64, each class column divided by its norm."""

    name = "fed3r"
    normalize = True
    features_dtype = TorchDtype("float64")

    def __init__(self, dim: int, num_classes: int, lam: Annotated[float, "ridge λ (> 0)"] = 0.01,
                 bias: Annotated[bool, "fit a bias: a ones column, regularized by λ too"] = False) -> None:
        super().__init__(dim, num_classes)
        self._check_lam(lam)
        self.lam = lam
        self.bias = bias

    @staticmethod
    def _check_lam(lam: float) -> None:
        if not lam > 0:
            raise FedrayError(f"--lam must be > 0, got {lam}")

    @property
    def feature_dim(self) -> int:
        """Dimension of the transformed features (before the bias column)."""
        return self.dim

    @property
    def design_dim(self) -> int:
        return self.feature_dim + int(self.bias)

    def _design(self, features: torch.Tensor) -> torch.Tensor:
        x = self.transform(features).to(torch.float64)
        if self.bias:
            x = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], dim=1)
        return x

    def client_statistics(self, batch: ClientBatch) -> RidgeStatistics:
        x = self._design(batch.features)
        _, sums = class_sums(x, batch.labels, self.num_classes)
        return RidgeStatistics(gram(x), sums.T.contiguous())

    def compact_statistics(self, batch: ClientBatch) -> tuple[RidgeStatistics, HeldClasses]:
        """Each client's ZᵀZ by its distinct entries and its ZᵀY at the columns of its classes: its class sums (k × d,
        as :func:`~fedray.methods.base.class_sums` adds them), transposed, not copied (what maps them reads them in any
        layout). Without a feature map the design rows of the whole batch are made at once (a conversion and a ones
        column: row by row exact), and every client's class sums in one pass; a feature map's rows are computed
        client by client, as the client's own upload computes them (a GEMM's rows may round differently in another
        batch)."""
        held = HeldClasses.of(batch)
        offsets = batch.offsets.tolist()
        if type(self).transform is ClosedFormMethod.transform:
            design = self._design(batch.features)
            sums = held.class_sums(design)[1]
        else:
            designs, client_sums = [], []
            for position, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
                designs.append(self._design(batch.features[start:end].clone()))
                pairs = held.of_client(position)
                labels = held.local_labels(batch, position)
                client_sums.append(class_sums(designs[-1], labels, pairs.stop - pairs.start)[1])
            design, sums = torch.cat(designs), torch.cat(client_sums)
        return RidgeStatistics(client_gram_triangles(design, offsets), sums.T), held

    def combine(self, a: RidgeStatistics, b: RidgeStatistics) -> RidgeStatistics:
        return RidgeStatistics(a.gram + b.gram, a.targets + b.targets)

    def upload_parts(self) -> UploadParts:
        return RIDGE_SUMS

    def solve(self, stats: RidgeStatistics) -> Classifier:
        """The ridge solution over the design (features and, with a bias, the ones column: λ regularizes both).

        With a bias, w_c and b_c are both divided by ‖w_c‖ alone, as the Fed3R
        code does (``normalize_W`` in ``src/fed3r.py``): scores are then the
        cosine-like w_cᵀz/‖w_c‖ plus a bias on the same scale. Dividing the
        stacked [w_c; b_c] by its joint norm instead changes every class's
        scale by a different factor and so the argmax.
        """
        regularized = stats.gram + self.lam * torch.eye(self.design_dim, dtype=torch.float64)
        solution = self._solve_system(regularized, stats.targets)
        weight, bias = (solution[:-1], solution[-1]) if self.bias else (solution, None)
        if self.normalize:
            norms = column_norms(weight)
            weight = weight / norms
            bias = None if bias is None else bias / norms
        return Classifier(weight.contiguous(), None if bias is None else bias.contiguous())

    def _solve_system(self, matrix: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        return spd_solve(matrix, rhs)

    def upload_floats(self, federation: Federation) -> np.ndarray:
        p = float(self.design_dim)
        return federation.client_num_classes * p + p * p

    def statistics_flops(self, sizes: np.ndarray) -> np.ndarray:
        p = self.design_dim
        return 2.0 * sizes * p * p + sizes * p

    def paper_costs(self, federation: Federation) -> PaperCosts:
        """FedCOF App. H: M·p + K·p²; Fed3R App. D: p² + p·C per client; Fed3R App. E: n_k(½p(p+1) + p·C) multiply-adds.

        p is the design's width: d (D for Fed3R-RF, whose random-feature map
        Fed3R's Appendix E does not count: "the same of FED3R, with the sole
        exception that the latent feature space is D-dimensional"), plus 1 with
        a bias. FFC has Fed3R's statistics and is counted as Fed3R.
        """
        p, sizes = float(self.design_dim), federation.client_sizes.astype(np.float64)
        return PaperCosts(
            fedcof_floats=self.upload_floats(federation),
            fed3r_floats=np.full(federation.num_clients, p * p + p * self.num_classes),
            fed3r_macs=sizes * (p * (p + 1) / 2 + p * self.num_classes),
            forward_passes=sizes,
        )


class Fed3RRandomFeatures(Fed3R):
    """Fed3R on D random Fourier features of the RBF kernel exp(-‖z−ζ‖²/2σ²), fixed by seed.

    φ(z) = √(2/D) cos(zΩ + b), Ω ~ N(0, σ⁻²) of shape (d, D), b ~ U[0, 2π). The
    map travels with the method object, so every shard applies the same one.

    σ defaults to √d, a scale-aware choice that needs no data: for features
    whose coordinates spread by about 1 (standardized features, the synthetic
    stand-ins), two samples lie about √(2d) apart, so the kernel neither
    vanishes nor flattens into a linear one between typical pairs. Fed3R
    (Appendix C) tuned σ once on Landmarks and used σ = 1000 throughout, for
    MobileNetV2 features; the Fed3R presets set that value (``--rf-sigma
    1000``). A data-driven choice (the median pairwise distance) would cost
    the federation an extra round, which the paper does not spend.
    """

    name = "fed3r-rf"
    features_dtype = None  # the random-feature map is computed on the stored features

    def __init__(
        self, dim: int, num_classes: int, lam: Annotated[float, "ridge λ (> 0)"] = 0.01,
        bias: Annotated[bool, "fit a bias: a ones column, regularized by λ too"] = False,
        rf_dim: Annotated[int, "random features D"] = 5000,
        rf_sigma: Annotated[float | None, "RBF bandwidth σ; None: √d", Unset(
            "√d, about the distance between samples of unit-spread features; the Fed3R paper used 1000 on MobileNetV2 "
            "features")] = None, seed: int = 0,
    ) -> None:
        super().__init__(dim, num_classes, lam, bias)
        rf_sigma = math.sqrt(dim) if rf_sigma is None else rf_sigma
        if rf_dim < 1:
            raise FedrayError(f"--rf-dim must be ≥ 1, got {rf_dim}")
        if not rf_sigma > 0:
            raise FedrayError(f"--rf-sigma must be > 0, got {rf_sigma}")
        self.rf_dim = rf_dim
        self.rf_sigma = rf_sigma
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        self.omega = torch.randn(dim, rf_dim, generator=g) / rf_sigma
        self.phase = torch.rand(rf_dim, generator=g) * (2 * math.pi)

    @property
    def feature_dim(self) -> int:
        return self.rf_dim

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        return math.sqrt(2.0 / self.rf_dim) * torch.cos(rowwise_matmul(features, self.omega) + self.phase)

    def statistics_flops(self, sizes: np.ndarray) -> np.ndarray:
        return super().statistics_flops(sizes) + 2.0 * sizes * self.dim * self.rf_dim

    def arrays(self) -> dict[str, np.ndarray]:
        return {"rf_omega": self.omega.numpy(), "rf_phase": self.phase.numpy()}

    def recorded(self) -> dict[str, object]:
        """σ, √d when not given."""
        return {"rf_sigma": self.rf_sigma}


class FastFederatedCalibration(Fed3R):
    """SphereFed's FFC: ridge on L2-normalized features, columns not normalized.

    SphereFed's FFC (its Eqs. 6–7) is the exact least squares, W = (ZᵀZ)⁻¹ZᵀY:
    ``--lam 0``. A singular ZᵀZ (fewer samples than dimensions, or collinear
    features) is then an error rather than a silent pseudo-inverse. The
    default λ = 0.01 keeps the solve well posed on any federation.
    """

    name = "ffc"
    normalize = False
    features_dtype = None  # the features are normalized as stored

    def __init__(self, dim: int, num_classes: int,
                 lam: Annotated[float, "ridge λ (≥ 0; 0: SphereFed's exact least squares)"] = 0.01,
                 bias: Annotated[bool, "fit a bias: a ones column, regularized by λ too"] = False) -> None:
        super().__init__(dim, num_classes, lam, bias)

    @staticmethod
    def _check_lam(lam: float) -> None:
        if not lam >= 0:
            raise FedrayError(f"--lam must be ≥ 0 for FFC, got {lam}")

    def _solve_system(self, matrix: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        if self.lam > 0:
            return super()._solve_system(matrix, rhs)
        factor, info = torch.linalg.cholesky_ex(matrix)
        if int(info) != 0:
            raise FedrayError(f"FFC with --lam 0 (exact least squares): ZᵀZ ({len(matrix)} × {len(matrix)}) is singular "
                              f"(fewer samples than dimensions, or collinear features); give --lam > 0")
        return torch.cholesky_solve(rhs, factor)

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(features, dim=1)
