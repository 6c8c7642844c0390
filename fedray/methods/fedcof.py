"""FedCOF: a ridge-like classifier whose Gram matrix is estimated from class means alone.

Clients upload one mean (and count) per class they hold. The server estimates
each class covariance from the spread of the received means around the class
mean, Σ̂_c = 1/(K_c−1) Σ_k n_kc (μ_kc−μ_c)(μ_kc−μ_c)ᵀ + γI (γI alone when
K_c = 1), forms Ĝ = Σ_c (N_c−1) Σ̂_c + N μ_g μ_gᵀ and solves W = Ĝ⁻¹ B with
B = [N_c μ_c]. Because the weight w_c = (N_c−1)/(K_c−1) of a mean is known only
once all means are in, the statistics keep every received (class, count, mean)
row, and Ĝ is one weighted GEMM over those rows, never a d×d matrix per class:
since Σ_k n_kc μ_kc = N_c μ_c, the spread term equals
Σ_rows n w_c μ_kc μ_kcᵀ − Σ_c w_c N_c μ_c μ_cᵀ.

In a run through shards the rows stay in the shards that computed them
(:meth:`FedCOF.kept_in_shards`): the server receives the class totals and the
number of means per class, sends back w, and the shards return their part of
the weighted GEMM (:meth:`FedCOF.second_pass`), so no process holds every mean.

With ``between_class`` (FedCOF §4.3, Table 2, App. F: the ablation the paper
argues against) Ĝ keeps the between-class scatter G_btw = Σ_c N_c(μ_c−μ_g)(μ_c−μ_g)ᵀ
of Proposition 2 (Eq. 7). Since Σ_c N_c μ_c = N μ_g, G_btw + N μ_g μ_gᵀ =
Σ_c N_c μ_c μ_cᵀ, so Ĝ = Σ_c (N_c−1) Σ̂_c + Σ_c N_c μ_c μ_cᵀ (Σ̂_c shrunk by
γI as without it): with the exact covariances (the oracle) and γ = 0
it is Σ zzᵀ = ZᵀZ, and W is unregularized ridge's (ZᵀZ)⁻¹ZᵀY, columns normalized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import numpy as np

from fedray.core.accounting import PaperCosts
from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.methods.base import (ClientBatch, Classifier, ClosedFormMethod, TorchDtype, class_divisors, class_sums,
                                 gram, normalize_columns, spd_solve)
from fedray.methods.ncm import CLASS_SUMS
from fedray.methods.upload_parts import ClientRows, SampleSum, UploadParts

torch = lazy_module("torch", globals())

if TYPE_CHECKING:
    from fedray.core.federation import Federation


@dataclass
class MeanBlock:
    """Received means: their class, the samples behind each, and the means (rows)."""

    classes: torch.Tensor
    counts: torch.Tensor
    means: torch.Tensor


@dataclass
class MeanRows:
    """Class totals, the number of means received per class, and every received mean, kept as the blocks they arrived
    in (no copying on combine; in a run through shards they stay in the shards, see :meth:`FedCOF.kept_in_shards`)."""

    counts: torch.Tensor
    sums: torch.Tensor
    received: torch.Tensor
    blocks: list[MeanBlock]


@dataclass
class ClassCovarianceSums:
    """What full class covariances aggregate to (FedCOF Eq. 24): Σ zzᵀ plus class sums."""

    counts: torch.Tensor
    sums: torch.Tensor
    gram: torch.Tensor


@dataclass
class ClassSquareSums:
    """What diagonal or spherical class covariances aggregate to: per class Σ z∘z (C × d), or Σ ‖z‖² (C × 1)."""

    counts: torch.Tensor
    sums: torch.Tensor
    squares: torch.Tensor


COVARIANCES = ("full", "diagonal", "spherical")

MEAN_ROWS = UploadParts(CLASS_SUMS.sums,
                        ClientRows("blocks.0.classes", "blocks.0.counts", "blocks.0.means", "received"))
"""A client's upload: its class totals, and its one block of (class, count, mean) rows with their number per class."""


BETWEEN_CLASS = "keep the between-class scatter Σ_c N_c(μ_c−μ_g)(μ_c−μ_g)ᵀ in G (FedCOF §4.3, Table 2: ridge's G)"


class FedCOF(ClosedFormMethod[MeanRows]):
    """Class covariances estimated from the spread of the clients' class means; W = Ĝ⁻¹[N_c μ_c], columns normalized."""

    name = "fedcof"
    features_dtype = TorchDtype("float64")
    uploads_summed = False

    def __init__(self, dim: int, num_classes: int, gamma: Annotated[float, "covariance shrinkage γ (≥ 0)"] = 0.1,
                 means_per_class: Annotated[int, "means per class per client (Appendix E)"] = 1,
                 between_class: Annotated[bool, BETWEEN_CLASS] = False, seed: int = 0) -> None:
        super().__init__(dim, num_classes)
        if gamma < 0:
            raise FedrayError(f"--gamma must be ≥ 0, got {gamma}")
        if means_per_class < 1:
            raise FedrayError(f"--means-per-class must be ≥ 1, got {means_per_class}")
        self.gamma = gamma
        self.means_per_class = means_per_class
        self.between_class = between_class
        self.seed = seed

    def subsets_of(self, size: np.ndarray) -> np.ndarray:
        """Means a client sends for a class it holds ``size`` samples of (FedCOF Appendix E).

        With M means per class asked for, a class of n ≥ 4 samples is split into
        min(M, ⌊n/2⌋) disjoint random subsets, so every mean has ≥ 2 samples.
        """
        return np.where(size >= 4, np.minimum(self.means_per_class, size // 2), 1)

    def _subsets(self, batch: ClientBatch, pair: np.ndarray) -> np.ndarray:
        """Subset number of each row: ⌊n/M'⌋ samples per subset, the last one taking the remainder."""
        part = np.zeros(len(pair), dtype=np.int64)
        order = np.argsort(pair, kind="stable")
        groups, starts, sizes = np.unique(pair[order], return_index=True, return_counts=True)
        parts = self.subsets_of(sizes)
        for group, start, size, count in zip(groups[parts > 1], starts[parts > 1], sizes[parts > 1], parts[parts > 1]):
            rows = order[start : start + size]
            client, label = divmod(int(group), self.num_classes)
            rng = np.random.default_rng([self.seed, int(batch.clients[client]), label])
            part[rows[rng.permutation(size)]] = np.minimum(np.arange(size) // (size // count), count - 1)
        return part

    def client_statistics(self, batch: ClientBatch) -> MeanRows:
        labels = batch.labels.numpy()
        pair = batch.client_of_row.numpy() * self.num_classes + labels
        if self.means_per_class > 1:
            pair = pair * self.means_per_class + self._subsets(batch, pair)
        groups, group_of_row = np.unique(pair, return_inverse=True)
        row_count, row_sum = class_sums(batch.features, torch.from_numpy(group_of_row), len(groups))
        counts, sums = class_sums(batch.features, batch.labels, self.num_classes)
        row_class = torch.from_numpy(labels[np.unique(group_of_row, return_index=True)[1]]).long()
        received = torch.bincount(row_class, minlength=self.num_classes).to(torch.float64)
        return MeanRows(counts, sums, received, [MeanBlock(row_class, row_count, row_sum / row_count.unsqueeze(1))])

    def combine(self, a: MeanRows, b: MeanRows) -> MeanRows:
        return MeanRows(a.counts + b.counts, a.sums + b.sums, a.received + b.received, a.blocks + b.blocks)

    def upload_parts(self) -> UploadParts:
        return MEAN_ROWS

    def kept_in_shards(self, stats: MeanRows) -> tuple[MeanRows, list[MeanBlock]]:
        """The received means stay in the shards (M × d floats: 60 GB at a million iNat-like clients); the server
        gets the class totals and the number of means per class, which fix each mean's weight."""
        return MeanRows(stats.counts, stats.sums, stats.received, []), stats.blocks

    def label_statistics(self, batch: ClientBatch) -> MeanRows:
        """The class totals (sums of width 0) and the number of means per class: labels alone fix both, so every
        evaluation's weights w_c are known before the pass. Counted by :meth:`client_statistics` itself, to its bits."""
        return self.kept_in_shards(self.client_statistics(batch))[0]

    def second_pass_request(self, total: MeanRows) -> torch.Tensor | None:
        """Each class's weight w_c = (N_c − 1)/(K_c − 1) (0 for a class with one mean), once all means are counted."""
        return None if total.blocks else self.weights(total)

    def second_pass(self, request: torch.Tensor, blocks: list[MeanBlock]) -> torch.Tensor | None:
        """Σ over the kept means of n w_c μμᵀ (None where none are kept), block after block."""
        if not blocks:
            return None
        total = gram(blocks[0].means, blocks[0].counts * request[blocks[0].classes])
        for block in blocks[1:]:
            total += gram(block.means, block.counts * request[block.classes])
        return total

    def solve_second(self, total: MeanRows, second: torch.Tensor | None) -> Classifier:
        return self._solve_gram(self._spread(total, second), total.counts, total.sums)

    def weights(self, stats: MeanRows) -> torch.Tensor:
        """w_c = (N_c − 1)/(K_c − 1) for a class with K_c > 1 received means, else 0."""
        received = stats.received
        return torch.where(received > 1, (stats.counts - 1) / (received - 1).clamp(min=1), 0.0).to(torch.float64)

    def _spread(self, stats: MeanRows, weighted_means: torch.Tensor | None) -> torch.Tensor:
        """The spread from Σ_rows n w_c μμᵀ (``weighted_means``; None: no means) and the class totals."""
        means = stats.sums / class_divisors(stats.counts).unsqueeze(1)
        between = gram(means, self.weights(stats) * stats.counts)
        return -between if weighted_means is None else weighted_means - between

    def _solve_gram(self, spread: torch.Tensor, counts: torch.Tensor, sums: torch.Tensor) -> Classifier:
        """W from the within-class scatter Σ_c (N_c−1) Σ̂_c (``spread``), to which the global term N μ_g μ_gᵀ is added
        (with ``between_class``, Σ_c N_c μ_c μ_cᵀ = G_btw + N μ_g μ_gᵀ) and the shrinkage."""
        if self.between_class:
            return self._solve(spread + gram(sums, 1 / class_divisors(counts)), counts, sums)
        total = counts.sum()
        global_mean = sums.sum(0) / total
        return self._solve(spread + total * torch.outer(global_mean, global_mean), counts, sums)

    def _solve(self, second_moments: torch.Tensor, counts: torch.Tensor, sums: torch.Tensor) -> Classifier:
        """W = (G + γ Σ_c (N_c−1)⁺ I)⁻¹ [N_c μ_c], columns normalized, from G (``second_moments``, shrunk in place)."""
        second_moments.diagonal().add_(self.gamma * (counts - 1).clamp(min=0).sum())
        return Classifier(normalize_columns(spd_solve(second_moments, sums.T.contiguous())))

    def solve(self, stats: MeanRows) -> Classifier:
        return self._solve_gram(self.spread(stats), stats.counts, stats.sums)

    def spread(self, stats: MeanRows) -> torch.Tensor:
        """Σ_c (N_c−1) Σ̂_c without shrinkage: the between-client-means scatter, weighted."""
        return self._spread(stats, self.second_pass(self.weights(stats), stats.blocks))

    def rows_per_client(self, federation: Federation) -> np.ndarray:
        """Mean rows each client uploads (one per class it holds unless several means are asked for)."""
        if self.means_per_class == 1:
            return federation.client_num_classes
        return federation.client_class_counts(self.subsets_of)

    def upload_floats(self, federation: Federation) -> np.ndarray:
        return self.rows_per_client(federation) * float(self.dim)

    def statistics_flops(self, sizes: np.ndarray) -> np.ndarray:
        return sizes * self.dim

    def paper_costs(self, federation: Federation) -> PaperCosts:
        """FedCOF App. H: M·d (M·(d + d²) for the oracle; with several means per class, M counts every mean sent)."""
        return PaperCosts(fedcof_floats=self.upload_floats(federation),
                          forward_passes=federation.client_sizes.astype(np.float64))


CovarianceSums = ClassCovarianceSums | ClassSquareSums


class FedCOFOracle(FedCOF):
    """FedCOF with clients sharing their class covariances (the paper's upper bound), or, with ``covariance``, only
    their diagonals or their spherical part σ²I, σ² = trace/d (FedCOF App. L, Fig. 9 right).

    Each client sends, per class it holds, its count n_kc, mean μ_kc and covariance S_kc (full: d², diagonal: d,
    spherical: 1 float). The server merges them exactly into the pooled class covariance, (N_c−1) Σ_c =
    Σ_k [(n_kc−1) S_kc + n_kc μ_kc μ_kcᵀ] − N_c μ_c μ_cᵀ, and Ĝ = Σ_c (N_c−1) Σ_c + N μ_g μ_gᵀ (+ shrinkage, and
    G_btw with ``between_class``, see the module). Shared diagonals merge into diag(Σ_c) exactly, traces into
    tr(Σ_c): the server then uses D_c = diag(Σ_c), or D_c = tr(Σ_c)/d · I, in place of Σ_c, its off-diagonal part
    zero as the clients did not send it (the spread of the means is not used off the diagonal either: that would mix
    in FedCOF's own estimator), so the ablation isolates the covariance's structure. Only Σ_c (N_c−1) D_c enters Ĝ,
    and it is a sum over samples: (n_kc−1) S_kc + n_kc μ_kc μ_kcᵀ is the client's Σ zzᵀ over the class (its diagonal
    Σ z∘z, its trace Σ ‖z‖²), which is what the statistics sum (Σ zzᵀ over all classes for the full matrices).
    """

    name = "fedcof-oracle"
    uploads_summed = True  # sums over samples: Σ zzᵀ, class counts and sums

    def __init__(self, dim: int, num_classes: int, gamma: Annotated[float, "covariance shrinkage γ (≥ 0)"] = 0.1,
                 covariance: Annotated[str, "what clients share of each class covariance: full (d² floats), diagonal "
                                            "(d) or spherical (1: σ² = trace/d)"] = "full",
                 between_class: Annotated[bool, BETWEEN_CLASS] = False) -> None:
        super().__init__(dim, num_classes, gamma, between_class=between_class)
        if covariance not in COVARIANCES:
            raise FedrayError(f"--covariance must be {', '.join(COVARIANCES[:-1])} or {COVARIANCES[-1]}, "
                              f"got {covariance!r}")
        self.covariance = covariance

    def client_statistics(self, batch: ClientBatch) -> CovarianceSums:  # type: ignore[override]
        counts, sums = class_sums(batch.features, batch.labels, self.num_classes)
        if self.covariance == "full":
            return ClassCovarianceSums(counts, sums, gram(batch.features))
        squares = batch.features.to(torch.float64) ** 2
        if self.covariance == "spherical":
            squares = squares.sum(1, keepdim=True)
        per_class = torch.zeros(self.num_classes, squares.shape[1], dtype=torch.float64)
        return ClassSquareSums(counts, sums, per_class.index_add_(0, batch.labels, squares))

    def combine(self, a: CovarianceSums, b: CovarianceSums) -> CovarianceSums:  # type: ignore[override]
        if isinstance(a, ClassCovarianceSums) and isinstance(b, ClassCovarianceSums):
            return ClassCovarianceSums(a.counts + b.counts, a.sums + b.sums, a.gram + b.gram)
        assert isinstance(a, ClassSquareSums) and isinstance(b, ClassSquareSums)
        return ClassSquareSums(a.counts + b.counts, a.sums + b.sums, a.squares + b.squares)

    def upload_parts(self) -> UploadParts:
        """Class totals and Σ zzᵀ (full), or each class's Σ z∘z (diagonal, C × d) or Σ ‖z‖² (spherical, C × 1)."""
        if self.covariance == "full":
            return UploadParts({**CLASS_SUMS.sums, "gram": SampleSum(2, symmetric=True, width_axis=0)})
        width = 1 if self.covariance == "diagonal" else None
        return UploadParts({**CLASS_SUMS.sums, "squares": SampleSum(2, by_class=True, width_axis=width)})

    def kept_in_shards(self, stats: CovarianceSums) -> tuple[CovarianceSums, None]:  # type: ignore[override]
        """Fixed-size sums: everything travels (the base class's default, which FedCOF's means override)."""
        return stats, None

    label_statistics = ClosedFormMethod.label_statistics  # no second pass: nothing to count ahead

    def second_pass_request(self, total: CovarianceSums) -> None:  # type: ignore[override]
        return None

    def solve(self, stats: CovarianceSums) -> Classifier:  # type: ignore[override]
        """Full: Σ_c (N_c−1) Σ_c = Σ zzᵀ − Σ_c N_c μ_c μ_cᵀ, the exact pooled within-class scatter (with
        ``between_class``, Ĝ is Σ zzᵀ itself). Diagonal: Σ_c (N_c−1) diag(Σ_c) = diag(Σ_c [Σ z∘z − N_c μ_c∘μ_c]);
        spherical: Σ_c (N_c−1) tr(Σ_c)/d · I = Σ_c [Σ ‖z‖² − N_c ‖μ_c‖²]/d · I."""
        if isinstance(stats, ClassCovarianceSums):
            if self.between_class:
                return self._solve(stats.gram.clone(), stats.counts, stats.sums)
            between = gram(stats.sums, 1 / stats.counts.clamp(min=1))
            return self._solve_gram(stats.gram - between, stats.counts, stats.sums)
        squared_sums = stats.sums**2 if self.covariance == "diagonal" else (stats.sums**2).sum(1, keepdim=True)
        scatter = (stats.squares - squared_sums / stats.counts.clamp(min=1).unsqueeze(1)).sum(0)
        diagonal = scatter if self.covariance == "diagonal" else (scatter / self.dim).expand(self.dim)
        return self._solve_gram(torch.diag(diagonal), stats.counts, stats.sums)

    def upload_floats(self, federation: Federation) -> np.ndarray:
        """A mean and a covariance per class held: d + d² floats (full), d + d (diagonal), d + 1 (spherical)."""
        covariance = {"full": self.dim * self.dim, "diagonal": self.dim, "spherical": 1}[self.covariance]
        return federation.client_num_classes * float(self.dim + covariance)

    def statistics_flops(self, sizes: np.ndarray) -> np.ndarray:
        if self.covariance == "full":
            return 2.0 * sizes * self.dim * self.dim + sizes * self.dim
        return 3.0 * sizes * self.dim  # the sums, and the squares and their sums
