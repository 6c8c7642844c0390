"""CCVR (Luo et al., NeurIPS 2021, "No Fear of Heterogeneity"), as the FedCOF paper adapts it (App. K, Table 9).

Each client sends, per class it holds, its count n_kc, mean μ_kc and covariance S_kc: the FedCOF oracle's upload,
M·(d + d²) floats (FedCOF App. H; M the client-class pairs). The server merges them exactly into each class's
Gaussian N(μ_c, Σ_c), the pooled mean and unbiased covariance of the class's features (FedCOF Eq. 24):
(N_c−1) Σ_c = Σ_k [(n_kc−1) S_kc + n_kc μ_kc μ_kcᵀ] − N_c μ_c μ_cᵀ. What a client's (n, μ, S) adds up to is
its per-class count, feature sum and Σ zzᵀ, so the statistics are those sums (:class:`ClassMoments`): C × d × d
float64 on the server, and in every shard (the per-class second moments are what CCVR needs beyond the oracle's
single pooled Σ zzᵀ; see :mod:`fedray.runtime.footprint`).

The server then samples ``virtual_per_class`` virtual features from each class's Gaussian (every class with at
least one sample; z = μ_c + Σ_c^½ ε, ε ~ N(0, I), with the symmetric square root Σ_c^½ = V Λ^½ Vᵀ of Σ_c's
eigendecomposition: a singular Σ_c, a class with fewer than d + 1 samples, is sampled too, as numpy's
``multivariate_normal`` does by SVD, but unlike numpy's factor V Λ^½, which rotates freely within a nearly repeated
eigenvalue's eigenvectors, Σ_c^½ is a continuous function of Σ_c, so that statistics summed in another order give the
same virtual features up to round-off), in float64, seeded from the run's seed (its own stream), class after class,
and trains a softmax classifier (W, b) over all C classes on them by mini-batch SGD with momentum (torch.optim.SGD,
cross-entropy, reshuffled every epoch from the seed's shuffling stream; W and b start at zero, the problem being
convex), on one thread so that its bits do not depend on the caller's threads. The fit runs in float32, as a torch
linear layer trains and as the head it gives is used (a training run's head and the evaluation are float32): float64
would double the cost of the largest step for digits the head then drops.

Defaults: the FedCOF authors' public code (dipamgoswami/FedCOF, Init_FT_LP/federated_main_round.py) aggregates the
class covariances "similar to CCVR" (Eq. 24, its oracle) and imports torch's MultivariateNormal, but ships no CCVR
sampler or trainer; Luo et al. published no code, and their paper is not among the papers here. So the default of
100 virtual features per class is the CCVR paper's setting as recalled, not checked, and the fit is a plain
linear-probe SGD (10 epochs, batch 64, lr 0.01, momentum 0.9); every one is an option. Cost on the server:
C·V samples of d floats, and 6·epochs·C·V·d·C FLOPs for the fit, at every evaluation of a closed-form run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import numpy as np

from fedray.core.accounting import PaperCosts
from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.core.threads import single_threaded
from fedray.methods.base import ClientBatch, Classifier, ClosedFormMethod, TorchDtype, class_sums, gram
from fedray.methods.ncm import CLASS_SUMS
from fedray.methods.upload_parts import SampleSum, UploadParts

torch = lazy_module("torch", globals())
F = lazy_module("torch.nn.functional", globals())

if TYPE_CHECKING:
    from fedray.core.federation import Federation

SAMPLING, SHUFFLING = 0, 1
"""The two random streams of a solve, each a generator seeded from (the run's seed, the stream)."""


def stream_seed(seed: int, stream: int) -> int:
    """A torch generator seed for ``stream`` of the run's ``seed`` (independent streams, none equal to another seed's)."""
    return int(np.random.SeedSequence([seed, stream]).generate_state(1, np.uint64)[0] >> np.uint64(1))


@dataclass
class ClassMoments:
    """Per class: the count (C,), the feature sum (C × d) and Σ zzᵀ (C × d × d), float64."""

    counts: torch.Tensor
    sums: torch.Tensor
    second: torch.Tensor


class CCVR(ClosedFormMethod[ClassMoments]):
    """A softmax classifier trained on virtual features sampled from the clients' pooled class Gaussians."""

    name = "ccvr"
    features_dtype = TorchDtype("float64")

    def __init__(self, dim: int, num_classes: int,
                 virtual_per_class: Annotated[int, "virtual features sampled per class (≥ 1)"] = 100,
                 virtual_epochs: Annotated[int, "epochs of SGD over the virtual features (≥ 1)"] = 10,
                 virtual_lr: Annotated[float, "learning rate of the softmax fit (> 0)"] = 0.01,
                 virtual_batch_size: Annotated[int, "mini-batch size of the softmax fit (≥ 1)"] = 64,
                 virtual_momentum: Annotated[float, "SGD momentum of the softmax fit (in [0, 1))"] = 0.9,
                 seed: int = 0) -> None:
        super().__init__(dim, num_classes)
        if virtual_per_class < 1:
            raise FedrayError(f"--virtual-per-class must be ≥ 1, got {virtual_per_class}")
        if virtual_epochs < 1:
            raise FedrayError(f"--virtual-epochs must be ≥ 1, got {virtual_epochs}")
        if not virtual_lr > 0:
            raise FedrayError(f"--virtual-lr must be > 0, got {virtual_lr}")
        if virtual_batch_size < 1:
            raise FedrayError(f"--virtual-batch-size must be ≥ 1, got {virtual_batch_size}")
        if not 0 <= virtual_momentum < 1:
            raise FedrayError(f"--virtual-momentum must be in [0, 1), got {virtual_momentum}")
        self.virtual_per_class = virtual_per_class
        self.virtual_epochs = virtual_epochs
        self.virtual_lr = virtual_lr
        self.virtual_batch_size = virtual_batch_size
        self.virtual_momentum = virtual_momentum
        self.seed = seed

    def client_statistics(self, batch: ClientBatch) -> ClassMoments:
        counts, sums = class_sums(batch.features, batch.labels, self.num_classes)
        second = torch.zeros(self.num_classes, self.dim, self.dim, dtype=torch.float64)
        labels = batch.labels.numpy()
        order = np.argsort(labels, kind="stable")
        classes, starts, sizes = np.unique(labels[order], return_index=True, return_counts=True)
        for label, start, size in zip(classes, starts, sizes):
            second[label] = gram(batch.features[torch.from_numpy(order[start : start + size])])
        return ClassMoments(counts, sums, second)

    def combine(self, a: ClassMoments, b: ClassMoments) -> ClassMoments:
        return ClassMoments(a.counts + b.counts, a.sums + b.sums, a.second + b.second)

    def upload_parts(self) -> UploadParts:
        return UploadParts({**CLASS_SUMS.sums, "second": SampleSum(2, by_class=True, width_axis=1)})

    def gaussians(self, stats: ClassMoments) -> tuple[torch.Tensor, torch.Tensor]:
        """Each class's mean (C × d) and unbiased covariance (C × d × d; 0 for a class with fewer than 2 samples)."""
        counts = stats.counts.clamp(min=1)
        means = stats.sums / counts.unsqueeze(1)
        scatter = stats.second - stats.sums.unsqueeze(2) * means.unsqueeze(1)  # Σ zzᵀ − N_c μ_c μ_cᵀ
        scatter = (scatter + scatter.transpose(1, 2)) / 2
        return means, scatter / (stats.counts - 1).clamp(min=1).view(-1, 1, 1)

    def virtual_features(self, stats: ClassMoments) -> tuple[torch.Tensor, torch.Tensor]:
        """``virtual_per_class`` samples (float64) of each seen class's Gaussian, class after class, and their labels."""
        means, covariances = self.gaussians(stats)
        generator = torch.Generator().manual_seed(stream_seed(self.seed, SAMPLING))
        seen = torch.nonzero(stats.counts > 0).flatten().tolist()
        features = torch.empty(len(seen) * self.virtual_per_class, self.dim, dtype=torch.float64)
        with single_threaded():  # the same bits whatever the caller's threads
            for row, label in enumerate(seen):
                values, vectors = torch.linalg.eigh(covariances[label])
                root = (vectors * values.clamp(min=0).sqrt()) @ vectors.T  # Σ_c^½, symmetric
                noise = torch.randn(self.virtual_per_class, self.dim, generator=generator, dtype=torch.float64)
                features[row * self.virtual_per_class : (row + 1) * self.virtual_per_class] = means[label] + noise @ root
        labels = torch.tensor(seen, dtype=torch.int64).repeat_interleave(self.virtual_per_class)
        return features, labels

    def fit(self, features: torch.Tensor, labels: torch.Tensor) -> Classifier:
        """The softmax classifier trained on ``features`` (cast to float32) by mini-batch SGD with momentum."""
        x = features.to(torch.float32)
        layer = torch.nn.Linear(self.dim, self.num_classes)
        torch.nn.init.zeros_(layer.weight)
        torch.nn.init.zeros_(layer.bias)
        optimizer = torch.optim.SGD(layer.parameters(), lr=self.virtual_lr, momentum=self.virtual_momentum)
        generator = torch.Generator().manual_seed(stream_seed(self.seed, SHUFFLING))
        with single_threaded(), torch.enable_grad():
            for _ in range(self.virtual_epochs):
                order = torch.randperm(len(x), generator=generator)
                for start in range(0, len(x), self.virtual_batch_size):
                    rows = order[start : start + self.virtual_batch_size]
                    optimizer.zero_grad()
                    F.cross_entropy(layer(x[rows]), labels[rows]).backward()
                    optimizer.step()
        return Classifier(layer.weight.detach().T.contiguous(), layer.bias.detach().clone())

    def solve(self, stats: ClassMoments) -> Classifier:
        if not bool((stats.counts > 0).any()):
            return Classifier(torch.zeros(self.dim, self.num_classes), torch.zeros(self.num_classes))
        return self.fit(*self.virtual_features(stats))

    def upload_floats(self, federation: Federation) -> np.ndarray:
        """A mean and a covariance per class held: M·(d + d²) floats (FedCOF App. H, as the oracle's)."""
        return federation.client_num_classes * float(self.dim + self.dim * self.dim)

    def statistics_flops(self, sizes: np.ndarray) -> np.ndarray:
        return 2.0 * sizes * self.dim * self.dim + sizes * self.dim

    def paper_costs(self, federation: Federation) -> PaperCosts:
        """FedCOF App. H: M·(d + d²), as FedCOF-Oracle."""
        return PaperCosts(fedcof_floats=self.upload_floats(federation),
                          forward_passes=federation.client_sizes.astype(np.float64))
