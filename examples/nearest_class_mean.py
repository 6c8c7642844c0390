"""A closed-form method in one file: the nearest-class-mean classifier (FedNCM, Legate et al. 2023), written as a
researcher would write their own, against fedray's public interface only.

    fedray run --method examples/nearest_class_mean.py:NearestClassMean --dataset synthetic:inat-geo-100
    fedray run --method examples/nearest_class_mean.py:NearestClassMean --option normalize=false ...

Clients upload per-class feature sums and counts; the server's classifier
columns are the class means, divided by their norms unless ``normalize`` is
off. With the defaults it gives the built-in ``fedncm``'s classifier.
"""

from dataclasses import dataclass
from typing import Annotated

import numpy as np
import torch

import fedray


@dataclass
class ClassSums:
    counts: torch.Tensor  # (C,)
    sums: torch.Tensor  # (C, d)


class NearestClassMean(fedray.ClosedFormMethod):
    def __init__(self, dim: int, num_classes: int, normalize: Annotated[bool, "unit-norm class means"] = True) -> None:
        super().__init__(dim, num_classes)
        self.normalize = normalize

    def client_statistics(self, batch: fedray.ClientBatch) -> ClassSums:
        """The summed statistics of the batch's clients (one float64 scatter-add: sums over samples add up)."""
        counts = torch.bincount(batch.labels, minlength=self.num_classes).to(torch.float64)
        sums = torch.zeros(self.num_classes, self.dim, dtype=torch.float64)
        sums.index_add_(0, batch.labels, batch.features.to(torch.float64))
        return ClassSums(counts, sums)

    def combine(self, a: ClassSums, b: ClassSums) -> ClassSums:
        return ClassSums(a.counts + b.counts, a.sums + b.sums)

    def solve(self, stats: ClassSums) -> fedray.Classifier:
        means = (stats.sums / stats.counts.clamp(min=1).unsqueeze(1)).T  # d × C
        if self.normalize:
            norms = means.norm(dim=0)
            means = means / torch.where(norms > 0, norms, torch.ones_like(norms))
        return fedray.Classifier(means.contiguous())

    def upload_floats(self, federation) -> np.ndarray:
        """One mean (d floats) per class a client holds: FedNCM's M·d (the default would count all C classes)."""
        return federation.client_num_classes * float(self.dim)

    def statistics_flops(self, sizes: np.ndarray) -> np.ndarray:
        return sizes * float(self.dim)
