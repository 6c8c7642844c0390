"""FedNCM: the nearest-class-mean classifier from summed class statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import numpy as np

from fedray.core.accounting import PaperCosts
from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.methods.base import (ClientBatch, Classifier, ClosedFormMethod, TorchDtype, class_divisors, class_sums,
                                 HeldClasses, normalize_columns)
from fedray.methods.upload_parts import SampleSum, UploadParts

torch = lazy_module("torch", globals())

if TYPE_CHECKING:
    from fedray.core.federation import Federation


@dataclass
class ClassSums:
    counts: torch.Tensor
    sums: torch.Tensor


CLASS_SUMS = UploadParts({"counts": SampleSum(0, by_class=True), "sums": SampleSum(1, by_class=True, width_axis=1)})
"""Per-class sample counts (C) and feature sums (C × d): FedNCM's upload, and the class totals of FedCOF's."""


DISTANCES = ("cosine", "euclidean")


class FedNCM(ClosedFormMethod[ClassSums]):
    """Clients send per-class sums and counts; the server's classifier is built from the global class means μ_c.

    ``distance`` cosine (FedNCM's head): W's columns are the normalized means. Euclidean (the classical nearest class
    mean the FedNCM paper contrasts it with): W = μ_c and b_c = −‖μ_c‖²/2, since ‖z − μ_c‖² = ‖z‖² − 2(zᵀμ_c −
    ‖μ_c‖²/2) and ‖z‖² is the same for every class, so the argmax of the scores is the argmin of the distances. A class
    never seen gets a zero column and bias, as with every method here.
    """

    name = "fedncm"
    features_dtype = TorchDtype("float64")

    def __init__(self, dim: int, num_classes: int,
                 distance: Annotated[str, "cosine (normalized class means) or euclidean (argmin ‖z − μ_c‖: "
                                          "W = μ_c, b_c = −‖μ_c‖²/2)"] = "cosine") -> None:
        super().__init__(dim, num_classes)
        if distance not in DISTANCES:
            raise FedrayError(f"--distance must be {' or '.join(DISTANCES)}, got {distance!r}")
        self.distance = distance

    def client_statistics(self, batch: ClientBatch) -> ClassSums:
        return ClassSums(*class_sums(batch.features, batch.labels, self.num_classes))

    def compact_statistics(self, batch: ClientBatch) -> tuple[ClassSums, HeldClasses]:
        """Each client's counts and class sums at the classes it holds."""
        held = HeldClasses.of(batch)
        return ClassSums(*held.class_sums(batch.features)), held

    def combine(self, a: ClassSums, b: ClassSums) -> ClassSums:
        return ClassSums(a.counts + b.counts, a.sums + b.sums)

    def upload_parts(self) -> UploadParts:
        return CLASS_SUMS

    def solve(self, stats: ClassSums) -> Classifier:
        means = stats.sums / class_divisors(stats.counts).unsqueeze(1)
        if self.distance == "euclidean":
            return Classifier(means.T.contiguous(), -0.5 * (means * means).sum(1))
        return Classifier(normalize_columns(means.T.contiguous()))

    def upload_floats(self, federation: Federation) -> np.ndarray:
        return federation.client_num_classes * float(self.dim)

    def statistics_flops(self, sizes: np.ndarray) -> np.ndarray:
        return sizes * self.dim

    def paper_costs(self, federation: Federation) -> PaperCosts:
        """FedCOF App. H: M·d (one mean per class held); FedNCM: one forward pass per sample; Fed3R's paper counts no FedNCM costs."""
        return PaperCosts(fedcof_floats=self.upload_floats(federation),
                          forward_passes=federation.client_sizes.astype(np.float64))
