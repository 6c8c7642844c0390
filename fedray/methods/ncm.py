"""FedNCM: the nearest-class-mean classifier from summed class statistics."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedray.core.accounting import PaperCosts
from fedray.core.federation import Federation
from fedray.methods.base import ClientBatch, Classifier, ClosedFormMethod, class_sums, normalize_columns


@dataclass
class ClassSums:
    counts: torch.Tensor
    sums: torch.Tensor


class FedNCM(ClosedFormMethod[ClassSums]):
    """Clients send per-class sums and counts; classifier rows are the normalized global means."""

    name = "fedncm"
    features_dtype = torch.float64

    def client_statistics(self, batch: ClientBatch) -> ClassSums:
        return ClassSums(*class_sums(batch.features, batch.labels, self.num_classes))

    def combine(self, a: ClassSums, b: ClassSums) -> ClassSums:
        return ClassSums(a.counts + b.counts, a.sums + b.sums)

    def solve(self, stats: ClassSums) -> Classifier:
        means = stats.sums / stats.counts.clamp(min=1).unsqueeze(1)
        return Classifier(normalize_columns(means.T.contiguous()))

    def upload_floats(self, federation: Federation) -> np.ndarray:
        return federation.client_num_classes * float(self.dim)

    def statistics_flops(self, sizes: np.ndarray) -> np.ndarray:
        return sizes * self.dim

    def paper_costs(self, federation: Federation) -> PaperCosts:
        """FedCOF App. H: M·d (one mean per class held); FedNCM: one forward pass per sample; Fed3R's paper counts no FedNCM costs."""
        return PaperCosts(fedcof_floats=self.upload_floats(federation),
                          forward_passes=federation.client_sizes.astype(np.float64))
