"""What a closed-form federated method is: three functions and its accounting.

``client_statistics`` maps the data of some clients to a statistics object,
``combine`` adds two of them (an associative, commutative monoid), ``solve``
turns the total into a classifier (a method whose solve needs a second look at
uploads that grow with the clients keeps them in the shards and asks for a
second pass: ``kept_in_shards``, ``second_pass_request``, ``second_pass``,
``solve_second``; FedCOF's means). A shard calls ``client_statistics`` on the
concatenated samples of many clients at once: for every method here that equals
combining the clients' individual statistics, and it is one GEMM instead of many.

This is the public interface (``fedray.ClosedFormMethod``): a researcher's own
method is one subclass in a file of their own, its options the typed keyword
arguments of its constructor (see :mod:`fedray.core.options`), used as
``--method path/to/file.py:Class``. The engine does everything else: sampling,
shards, tree reduction, evaluation, traffic and FLOPs, metrics, sweeps.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np

from fedray.core.accounting import PaperCosts
from fedray.core.lazy_modules import lazy_module
from fedray.core.threads import numpy_blas_single_threaded, single_threaded
from fedray.methods.triangle import Triangle
from fedray.methods.upload_parts import UploadParts

torch = lazy_module("torch", globals())

if TYPE_CHECKING:
    from fedray.core.federation import Federation

FLOAT_BYTES = 4
"""Uploads are counted as float32 values, the papers' convention."""

Stats = TypeVar("Stats")


@dataclass
class ClientBatch:
    """The samples of several clients, concatenated client after client (features in the method's ``features_dtype``)."""

    features: torch.Tensor
    labels: torch.Tensor
    offsets: np.ndarray
    clients: np.ndarray

    @property
    def client_of_row(self) -> torch.Tensor:
        """Each row's client, as its position in the batch (numpy's repeat: a quarter of torch's time on a chunk)."""
        return torch.from_numpy(np.repeat(np.arange(len(self.clients)), np.diff(self.offsets)))


@dataclass
class Classifier:
    """Scores are ``transform(z) @ weight + bias``; ``weight`` is (feature dim, C)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"W": self.weight.numpy()}
        if self.bias is not None:
            out["bias"] = self.bias.numpy()
        return out


class TorchDtype:
    """A class attribute read as torch's dtype ``name`` (``features_dtype = TorchDtype("float64")`` is
    ``torch.float64``), so that defining a method, as ``fedray --help`` does to read its options, imports no torch."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type) -> torch.dtype:
        return getattr(torch, self.name)


class ClosedFormMethod(ABC, Generic[Stats]):
    """A classifier computed in closed form from summed client statistics.

    Subclasses take ``(dim, num_classes, **options)``; a constructor that also
    takes ``seed`` gets the run's seed (every random choice must come from it).
    """

    name: ClassVar[str] = ""
    """The built-in's name for ``--method``; a plugin is named by its ``module:Class`` or ``file.py:Class``."""
    features_dtype: ClassVar[torch.dtype | None] = None
    """The dtype of ``batch.features`` in :meth:`client_statistics`; None: as stored (float32). A method whose
    statistics are float64 sums of the raw features (FedNCM, Fed3R, FedCOF) asks for float64, and the shard copies
    the clients' rows straight into it, in one pass instead of a gather and then a conversion (exact either way)."""
    uploads_summed: ClassVar[bool] = True
    """Whether the server only adds the clients' uploads together (FedNCM's class sums, Fed3R's Gram). False where it
    sees them client by client (FedCOF's mean rows, whose spread is its estimate): a postprocessor that protects only
    sums (a server's DP noise, secure aggregation) then refuses the run before it starts
    (:attr:`fedray.StageUploads.summed`)."""

    def __init__(self, dim: int, num_classes: int) -> None:
        self.dim = dim
        self.num_classes = num_classes

    def transform(self, features: torch.Tensor) -> torch.Tensor:
        """The client-side feature map applied before statistics and at test time."""
        return features

    def upload_parts(self) -> UploadParts:
        """What a client's statistics are made of, by their tensors' paths (:class:`~fedray.UploadParts`), for the
        postprocessors that treat them part by part (DP's sensitivities, noise on class counts). Default: every tensor
        a sum over the client's samples, nothing more said (such postprocessors then refuse the run in one line)."""
        return UploadParts()

    @abstractmethod
    def client_statistics(self, batch: ClientBatch) -> Stats: ...

    @abstractmethod
    def combine(self, a: Stats, b: Stats) -> Stats: ...

    @abstractmethod
    def solve(self, stats: Stats) -> Classifier: ...

    def compact_statistics(self, batch: ClientBatch) -> tuple[Stats, HeldClasses]:
        """Optional: the statistics of each client of ``batch`` on its own, where they can be nonzero, all in one
        value, with the classes each client holds (:meth:`HeldClasses.of` the batch). A tensor with an axis of classes
        (:attr:`~fedray.SampleSum.axis_of_classes` in :meth:`upload_parts`) holds along it one entry per (client, class)
        pair, client after client; every other tensor gains a first axis, one entry per client, and a symmetric matrix
        (:attr:`~fedray.SampleSum.symmetric`) is given by its distinct entries (one row of n(n + 1) / 2 values per
        client, in :class:`~fedray.methods.triangle.Triangle`'s order). Each client's entries are bit for bit what
        :meth:`client_statistics` gives for the client alone (at its classes: zero at the others).
        A method that gives them, and whose :meth:`combine` adds tensors entry by entry, lets a postprocessor that maps
        each value on its own (secure aggregation's quantization: :attr:`fedray.Postprocessor.entrywise`) treat a
        client's upload at the cost of its classes, not of all C, many clients at a time
        (:func:`offers_compact_statistics`)."""
        raise NotImplementedError(f"{type(self).__name__} gives no compact statistics")

    # --- a second pass over what stays in the shards (optional)

    def kept_in_shards(self, stats: Stats) -> tuple[Stats, Any]:
        """``stats`` (a shard's sum over some clients) split into what travels to the server and what stays in the
        shard, for :meth:`second_pass`: a part that grows with the clients (FedCOF's received means) whose use needs
        numbers known only once every upload is in. Default: everything travels, nothing stays (None)."""
        return stats, None

    def label_statistics(self, batch: ClientBatch) -> Stats | None:
        """What the labels of ``batch`` (its features of width 0) alone fix of its statistics, enough for
        :meth:`second_pass_request`: then the server knows every evaluation's request before the pass, and the shards
        add each kept part's :meth:`second_pass` for every later evaluation as they compute it, reading it once
        (FedCOF's weights w_c from the class counts and the number of means per class). None (the default): the
        requests are known only from what the server receives, and each evaluation runs its own second pass."""
        return None

    def second_pass_request(self, total: Stats) -> Any:
        """What the server sends the shards, given the total it received, so that they sum what stayed with them
        (:meth:`second_pass`); None (the default): :meth:`solve` needs no second pass."""
        return None

    def second_pass(self, request: Any, kept: Any) -> Any:
        """The second pass over one part ``kept`` (what :meth:`kept_in_shards` kept of some uploads the server has
        received), given ``request``; a shard adds its parts' results in upload order, and the shards' sums in a
        fixed tree order, with :meth:`combine_second` (None stands for nothing to add)."""
        raise NotImplementedError(f"{type(self).__name__} keeps statistics in the shards but has no second_pass")

    def combine_second(self, a: Any, b: Any) -> Any:
        return a + b

    def solve_second(self, total: Stats, second: Any) -> Classifier:
        """The classifier from the received ``total`` and the summed second pass."""
        raise NotImplementedError(f"{type(self).__name__} asks for a second pass but has no solve_second")

    def upload_floats(self, federation: Federation) -> np.ndarray:
        """Floats each client uploads (shape (K,)), counted in ``bytes_up`` as float32.

        Default: the floats in the statistics of one client with one sample,
        for every client; right for statistics of a fixed size (Fed3R's
        ZᵀZ and ZᵀY). Override it where the size depends on the client (the
        built-ins count the papers' conventions: FedNCM's M·d, one mean per
        class a client holds). ``federation`` has ``client_sizes``,
        ``client_num_classes`` and ``num_clients``.
        """
        return np.full(federation.num_clients, float(self.statistics_floats()))

    def statistics_floats(self) -> int:
        """The floats in a client's statistics as :meth:`client_statistics` returns them (one client with one sample):
        every client's, and their aggregate's, of a fixed size (what a secure sum masks)."""
        features = torch.zeros(1, self.dim, dtype=self.features_dtype or torch.float32)  # as the shards hand them over
        probe = ClientBatch(features, torch.zeros(1, dtype=torch.int64), np.array([0, 1]), np.array([0]))
        return floats_in(self.client_statistics(probe))

    def statistics_flops(self, sizes: np.ndarray) -> np.ndarray:
        """FLOPs a client with ``sizes`` samples spends on its statistics (feature extraction excluded).

        Default: not counted, NaN (``flops_client_avg`` is then NaN too); override to count.
        """
        return np.full(len(sizes), np.nan)

    def paper_costs(self, federation: Federation) -> PaperCosts:
        """Each client's one upload as the papers count it (:mod:`fedray.core.accounting`).

        Default: one backbone forward pass per sample (FedNCM's count, true of
        any method computing statistics of the cached features); the papers'
        float and multiply-add counts are undefined (None) for a method they
        do not describe. The built-ins override it with their papers' formulas.
        """
        return PaperCosts(forward_passes=federation.client_sizes.astype(np.float64))

    def arrays(self) -> dict[str, np.ndarray]:
        """Extra arrays a saved classifier needs besides W (e.g. a random feature map)."""
        return {}

    def recorded(self) -> dict[str, object]:
        """What the constructor resolved that the options did not say (Fed3R-RF's σ when none was given), by the names
        of this class's options: the run writes these values in ``config.yaml`` and in every row, in place of what
        was given, so that the record re-runs the same. Default: nothing."""
        return {}


def floats_in(statistics: object) -> int:
    """The number of floats in a statistics object: its tensors and arrays, in dataclasses, sequences or dicts."""
    if isinstance(statistics, (torch.Tensor, np.ndarray)):
        return int(statistics.size if isinstance(statistics, np.ndarray) else statistics.numel())
    if dataclasses.is_dataclass(statistics):
        return sum(floats_in(getattr(statistics, field.name)) for field in dataclasses.fields(statistics))
    if isinstance(statistics, dict):
        return sum(floats_in(value) for value in statistics.values())
    if isinstance(statistics, (list, tuple)):
        return sum(floats_in(value) for value in statistics)
    return 0


def class_sums(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class counts (C,) and feature sums (C, d), in float64."""
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    sums = torch.zeros(num_classes, features.shape[1], dtype=torch.float64)
    sums.index_add_(0, labels, features.to(torch.float64))
    return counts, sums


@dataclass(frozen=True)
class HeldClasses:
    """The classes each client of a batch holds, as (client, class) pairs, client after client and each client's
    classes increasing: where a method's compact statistics can be nonzero
    (:meth:`ClosedFormMethod.compact_statistics`). Counts and sums by pair are computed for the whole batch at once
    (:meth:`class_sums`), each pair's rows added in order from zero, as a client's own class sums add them: the same
    bits."""

    classes: torch.Tensor
    """Each pair's class."""
    pair_of_row: torch.Tensor
    """Each of the batch's rows' pair."""
    bounds: list[int]
    """Client i's pairs are ``bounds[i]:bounds[i + 1]``."""

    @classmethod
    def of(cls, batch: ClientBatch) -> HeldClasses:
        labels = batch.labels.numpy()
        width = int(labels.max()) + 1 if len(labels) else 1
        pairs, pair_of_row = np.unique(batch.client_of_row.numpy() * width + labels, return_inverse=True)  # sorted
        bounds = np.searchsorted(pairs, np.arange(len(batch.clients) + 1) * width).tolist()
        return cls(torch.from_numpy(pairs % width), torch.from_numpy(pair_of_row.reshape(-1)), bounds)

    def of_client(self, position: int) -> slice:
        """The pairs of the batch's client at ``position``."""
        return slice(self.bounds[position], self.bounds[position + 1])

    def class_sums(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's count and sum of ``rows`` (one a batch row): :func:`class_sums` with the pairs as classes."""
        return class_sums(rows, self.pair_of_row, len(self.classes))

    def local_labels(self, batch: ClientBatch, position: int) -> torch.Tensor:
        """The labels of the batch's client at ``position`` as indices into its classes."""
        start, end = batch.offsets[position], batch.offsets[position + 1]
        return self.pair_of_row[start:end] - self.bounds[position]


def offers_compact_statistics(method: ClosedFormMethod) -> bool:
    """Whether ``method`` gives :meth:`~ClosedFormMethod.compact_statistics` of its own statistics: a subclass that
    computes other statistics, or declares other parts, than the class it inherits them from does not."""
    def defining(name: str) -> type:
        return next(cls for cls in type(method).__mro__ if name in vars(cls))

    compact = defining("compact_statistics")
    return compact is not ClosedFormMethod and all(issubclass(compact, defining(name))
                                                   for name in ("client_statistics", "upload_parts"))


def class_divisors(counts: torch.Tensor) -> torch.Tensor:
    """What each class's sums are divided by for its mean: its count, or 1 for a class no client holds (zero sums).

    Not ``counts.clamp(min=1)``: a count may be real and below 1 (FedCOF App. I's noisy counts, ñ = max(n + σ, 0)),
    and its mean is still sums / ñ. For integer counts the two are the same, bit for bit.
    """
    return torch.where(counts > 0, counts, torch.ones_like(counts))


def gram(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """xᵀ diag(weights) x in float64: the hot GEMM of the ridge and covariance statistics.

    CPU tensors go through numpy's BLAS, as a symmetric rank-k update (numpy calls ``syrk`` for ``yᵀ @ y`` on one
    buffer): half a GEMM's flops, 2.4× faster than ``(w ⊙ x)ᵀ @ x`` at d = 1,280 on one thread, which is what
    FedCOF's second passes spend their time on. A weighted Gram is (√w ⊙ x)ᵀ(√w ⊙ x), less the same over the rows of
    negative weight (noisy counts, FedCOF App. I), so it stays exact up to float64 rounding and exactly symmetric.
    On one BLAS thread, whatever the process's CPUs, so that its bits are too. Other devices stay with torch's GEMM.
    """
    x = x.to(torch.float64)
    if x.device.type != "cpu":
        return (x if weights is None else x * weights.to(torch.float64).unsqueeze(1)).T @ x
    rows = x.numpy()
    with numpy_blas_single_threaded():
        if weights is None:
            return torch.from_numpy(rows.T @ rows)
        w = weights.to(torch.float64).numpy()
        scaled = rows * np.sqrt(np.abs(w))[:, None]
        negative = w < 0
        if not negative.any():
            return torch.from_numpy(scaled.T @ scaled)
        plus, minus = scaled[~negative], scaled[negative]
        return torch.from_numpy(plus.T @ plus - minus.T @ minus)


def client_gram_triangles(rows: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
    """The distinct entries (:class:`~fedray.methods.triangle.Triangle`) of :func:`gram` of each client's ``rows`` (a
    float64 CPU tensor; client i's are ``offsets[i]:offsets[i + 1]``), a row per client, bit for bit: each Gram computed
    as :func:`gram` computes it, by numpy's ``syrk``, from a copy at the start of a fresh tensor, where a client's own
    rows start (a BLAS may round differently at another alignment), into one matrix that stays in the caches. Many
    clients' small Grams at the cost of their products, not of a call and a tensor each (secure aggregation's compact
    statistics)."""
    width = rows.shape[1]
    triangle = Triangle.of(width)
    triangles = torch.empty(len(offsets) - 1, len(triangle.positions), dtype=torch.float64)
    scratch = torch.empty(int(np.diff(offsets).max(initial=0)), width, dtype=torch.float64).numpy()
    matrix = torch.empty(width, width, dtype=torch.float64).numpy()
    source, read = rows.numpy(), triangle.reader(matrix)
    with numpy_blas_single_threaded():
        for start, end, into in zip(offsets[:-1], offsets[1:], triangles.numpy()):
            copy = scratch[:end - start]
            np.copyto(copy, source[start:end])
            np.matmul(copy.T, copy, out=matrix)
            read(into)
    return triangles


def column_norms(weight: torch.Tensor) -> torch.Tensor:
    """Each column's norm, 1 for all-zero columns (unseen classes) so that dividing by it leaves them zero."""
    norms = torch.linalg.vector_norm(weight, dim=0)
    return torch.where(norms > 0, norms, torch.ones_like(norms))


def normalize_columns(weight: torch.Tensor) -> torch.Tensor:
    """Each column divided by its norm; all-zero columns (unseen classes) stay zero."""
    return weight / column_norms(weight)


def spd_solve(matrix: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve ``matrix @ X = rhs`` for a symmetric positive (semi)definite float64 matrix.

    Cholesky when the matrix is positive definite; a least-squares solve when it
    is singular (e.g. FedCOF before any class has two samples). On one thread
    (``single_threaded``): the same bits whatever the caller's threads.
    """
    with single_threaded():
        factor, info = torch.linalg.cholesky_ex(matrix)
        if int(info) == 0:
            return torch.cholesky_solve(rhs, factor)
        return torch.linalg.lstsq(matrix, rhs, driver="gelsd").solution
