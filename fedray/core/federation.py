"""A federation: who holds which sample, and where the samples' features come from.

The split table is small (one row per sample, no features); features are
produced by a :class:`FeatureSource` inside the process that needs them, so no
process ever holds the whole federation's features. A federation loaded from a
dataset spec remembers it (:attr:`Federation.spec`): a shard actor rebuilds the
federation from that line of text and reads only its own clients' features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from collections.abc import Callable, Iterator
from typing import ClassVar, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from fedray.core.lazy_modules import lazy_module
from fedray.core.errors import FedrayError

torch = lazy_module("torch", globals())

TRAIN, TEST = "train", "test"

SPLIT_SCHEMA = pa.schema(
    [
        pa.field("client_id", pa.string()),
        pa.field("sample_id", pa.int64(), nullable=False),
        pa.field("label", pa.int32(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
    ]
)
"""Columns every split table has; loaders may add more (e.g. ``image_id``)."""
STREAMED_ROWS = 16_384
"""Samples a shard of a federation that streams its features generates (or reads) at once for statistics."""


class FeatureSource(Protocol):
    """Produces float32 features for samples named by their ``sample_id``."""

    dim: int

    def features(self, split: str, sample_ids: np.ndarray) -> torch.Tensor:
        """Features of ``sample_ids`` of ``split`` as a (len(sample_ids), dim) float32 tensor."""
        ...


@dataclass(frozen=True)
class Federation:
    """A split table plus (optionally) the source of its features.

    ``table`` holds one row per sample with :data:`SPLIT_SCHEMA`'s columns;
    test rows have a null ``client_id``. Clients are numbered 0..K-1 in order of
    first appearance among the train rows; :attr:`train` is sorted by that
    number so that each client's samples are one contiguous slice.

    ``spec`` is a dataset spec that rebuilds this federation, split table and
    feature source, bit for bit in any process (see
    :func:`fedray.data.registry.load_federation`); None for one that exists only
    in memory (hand-built, re-split by code, features computed by a model).
    """

    name: str
    num_classes: int
    table: pa.Table
    source: FeatureSource | None = field(default=None, compare=False)
    spec: str | None = field(default=None, compare=False)

    streams_features: ClassVar[bool] = False
    """True for a federation too large for its shards to hold its features: they ask its source for a batch's rows
    each time they need them (each shard still asks only for its own clients')."""

    def __post_init__(self) -> None:
        if self.train.num_rows == 0:
            raise FedrayError(f"{self.name}: the federation has no training samples")
        labels = self.table.column("label")
        if pc.min(labels).as_py() < 0:
            raise FedrayError(f"{self.name}: negative label {pc.min(labels).as_py()}")
        if pc.max(labels).as_py() >= self.num_classes:
            raise FedrayError(
                f"{self.name}: label {pc.max(labels).as_py()} out of range for {self.num_classes} classes"
            )

    @classmethod
    def from_arrays(cls, features: object, labels: object, clients: object, split: object, num_classes: int | None = None,
                    name: str = "from_arrays") -> "Federation":
        """One row per sample: ``features`` (samples × d floats), ``labels`` (integers ≥ 0), ``clients`` (int or string
        client ids; a test row's is ignored), ``split`` ('train' or 'test'); numpy arrays, torch tensors or lists.

        The rows are checked as a Parquet file's are and give the federation that file would (see
        :mod:`fedray.core.schema`); C is ``num_classes``, else the largest label + 1. ``name`` names it in errors
        and, with a hash of its content, in a run's ``dataset`` column. The features are copied, held in memory.
        """
        from fedray.core.schema import arrays_federation  # the schema imports this module

        return arrays_federation(features, labels, clients, split, num_classes, name)

    @classmethod
    def from_table(cls, table: object, num_classes: int | None = None, name: str = "from_table") -> "Federation":
        """The rows of a pyarrow Table or polars DataFrame with the Parquet schema's columns (client_id, split, label,
        features), as :meth:`from_arrays` takes them; the schema metadata ``fedray.num_classes`` fixes C unless
        ``num_classes`` is given."""
        from fedray.core.schema import table_federation  # the schema imports this module

        return table_federation(table, name, num_classes)

    def require_features(self) -> FeatureSource:
        """The feature source; a split table without one cannot be run or exported."""
        if self.source is None:
            raise FedrayError(f"{self.name}: a split table without features (nothing to run on or export)")
        return self.source

    def require_test_rows(self) -> None:
        """A run evaluates on the test rows: without any, its accuracy would be NaN at every point."""
        if self.test.num_rows == 0:
            raise FedrayError(f"{self.name}: no test rows (split 'test'): nothing to evaluate a classifier on; add test rows")

    @property
    def dim(self) -> int:
        return self.require_features().dim

    @cached_property
    def train(self) -> pa.Table:
        rows = self.table.filter(pc.equal(self.table.column("split"), TRAIN))
        if rows.column("client_id").null_count:
            raise FedrayError(f"{self.name}: a train row has no client_id")
        codes = rows.column("client_id").combine_chunks().dictionary_encode()
        order = np.argsort(codes.indices.to_numpy(), kind="stable")
        rows = rows.take(order)
        return rows.append_column("client_index", pa.array(codes.indices.to_numpy()[order], pa.int32()))

    @cached_property
    def test(self) -> pa.Table:
        return self.table.filter(pc.equal(self.table.column("split"), TEST))

    @cached_property
    def client_offsets(self) -> np.ndarray:
        """Row offsets of each client's slice of :attr:`train` (length K + 1)."""
        counts = np.bincount(self.train.column("client_index").to_numpy(), minlength=0)
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @property
    def num_clients(self) -> int:
        return len(self.client_offsets) - 1

    @cached_property
    def client_sizes(self) -> np.ndarray:
        return np.diff(self.client_offsets)

    @cached_property
    def client_ids(self) -> list[str]:
        offsets = self.client_offsets[:-1]
        return self.train.column("client_id").take(pa.array(offsets)).to_pylist()

    @property
    def num_test(self) -> int:
        return self.test.num_rows

    @cached_property
    def client_num_classes(self) -> np.ndarray:
        """Number of distinct classes each client holds (summing to M)."""
        return self.client_class_counts(lambda counts: np.ones_like(counts))

    def client_class_counts(self, weight: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Σ over the classes each client holds of ``weight(n)``, n its samples of that class (ones: its classes)."""
        out = np.zeros(self.num_clients, dtype=np.result_type(weight(np.ones(1, np.int64))))
        for first, labels, offsets in self.label_chunks():
            clients = np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))
            pairs, counts = np.unique(clients * self.num_classes + labels, return_counts=True)
            np.add.at(out, first + pairs // self.num_classes, weight(counts))
        return out

    def label_chunks(self, samples: int = 1 << 18) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """``(first_client, labels, offsets)`` of consecutive runs of whole clients, about ``samples`` rows each (so a
        pass over every label holds one run at a time)."""
        offsets = self.client_offsets
        cuts = np.searchsorted(offsets, np.arange(samples, offsets[-1], samples), side="right")
        bounds = np.unique(np.concatenate([[0], cuts, [self.num_clients]]))
        for first, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            _, labels, run_offsets = self.train_arrays(first, end)
            yield first, labels.astype(np.int64), run_offsets

    def train_arrays(self, first_client: int, end_client: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(sample_ids, labels, offsets)`` of clients ``first_client..end_client-1``."""
        start, stop = self.client_offsets[first_client], self.client_offsets[end_client]
        rows = self.train.slice(start, stop - start)
        offsets = self.client_offsets[first_client : end_client + 1] - start
        return rows.column("sample_id").to_numpy(), rows.column("label").to_numpy(), offsets

    def test_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.test.column("sample_id").to_numpy(), self.test.column("label").to_numpy()

    def summary(self) -> dict[str, object]:
        """K, C, N, N_test, M and client-size quantiles (what ``fedray data info`` prints)."""
        sizes = self.client_sizes
        quantiles = np.quantile(sizes, [0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0])
        return {
            "dataset": self.name,
            "clients_K": self.num_clients,
            "classes_C": self.num_classes,
            "train_N": int(sizes.sum()),
            "test_N": self.num_test,
            "client_class_pairs_M": int(self.client_num_classes.sum()),
            "dim_d": self.source.dim if self.source is not None else None,
            "client_size_mean": float(sizes.mean()),
            "client_size_quantiles": dict(
                zip(["min", "p25", "median", "p75", "p90", "p99", "max"], [float(q) for q in quantiles])
            ),
        }


def split_table(
    client_id: pa.Array | list | None,
    sample_id: np.ndarray,
    label: np.ndarray,
    split: np.ndarray | list,
    **extra: pa.Array,
) -> pa.Table:
    """Build a split table with :data:`SPLIT_SCHEMA` (plus ``extra`` columns)."""
    columns = {
        "client_id": pa.array(client_id, pa.string()),
        "sample_id": pa.array(sample_id, pa.int64()),
        "label": pa.array(label, pa.int32()),
        "split": pa.array(split, pa.string()),
        **extra,
    }
    return pa.table(columns)
