"""The bring-your-own rows, one per sample: checked once, whichever way they arrive.

Schema:
  client_id  int or string, null for test rows (ignored there)
  split      string, "train" or "test"
  label      integer ≥ 0
  features   list<float> or fixed_size_list<float>[d], the same length d in every row
The optional schema metadata key ``fedray.num_classes`` fixes C (else max label + 1, refused when
that is over 100,000 and over 10 × the distinct labels present: a stray label would size every
class statistic and the classifier).

A Parquet file (:mod:`fedray.data.parquet`), a pyarrow or polars table
(:meth:`Federation.from_table`) and plain arrays (:meth:`Federation.from_arrays`)
go through these checks and give, for the same rows, the same federation: the
split table with sample ids = row numbers, clients numbered by first appearance
among the train rows, the same C, the same float32 features. Bad rows are refused
with one line naming ``where`` (the file, or the federation's name) and the row.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from fedray.core.lazy_modules import lazy_module
from fedray.core.federation import TEST, TRAIN, Federation, split_table
from fedray.core.errors import FedrayError

torch = lazy_module("torch", globals())

REQUIRED = ("client_id", "split", "label", "features")
NUM_CLASSES_KEY = b"fedray.num_classes"
LARGE_IMPLICIT_CLASSES = 100_000
SPARSE_LABELS_FACTOR = 10
"""C = max label + 1 is refused when above both: a class count only metadata may set."""
FINITE_CHECK_ROWS = 65_536
"""Rows checked for NaN and inf at a time (the check's temporary is a boolean per value)."""


def check_columns(where: str, names: list[str]) -> None:
    missing = [name for name in REQUIRED if name not in names]
    if missing:
        raise FedrayError(f"{where}: missing column(s) {', '.join(missing)}; expected {', '.join(REQUIRED)}")


def split_rows(table: pa.Table, where: str, metadata: dict | None) -> tuple[pa.Table, int]:
    """The split table (:data:`~fedray.core.federation.SPLIT_SCHEMA`) and C of ``table``'s client_id, split and label
    columns; ``metadata`` is the schema metadata (C from :data:`NUM_CLASSES_KEY`)."""
    if table.num_rows == 0:
        raise FedrayError(f"{where}: no rows")
    split = table.column("split")
    if not (_is_string(split.type) or pa.types.is_dictionary(split.type)):
        raise FedrayError(f"{where}: column 'split' must be strings 'train'/'test', got {split.type}")
    split = split.cast(pa.string())
    bad_split = pc.invert(pc.is_in(split, pa.array([TRAIN, TEST]))).fill_null(True)
    if pc.any(bad_split).as_py():
        row = int(np.argmax(bad_split.to_numpy(zero_copy_only=False)))
        raise FedrayError(f"{where}: row {row}: split must be 'train' or 'test', got {split[row].as_py()!r}")
    label = table.column("label")
    if not pa.types.is_integer(label.type):
        raise FedrayError(f"{where}: column 'label' must be integers, got {label.type}")
    if label.null_count:
        raise FedrayError(f"{where}: column 'label' has nulls")
    labels = label.to_numpy()
    if labels.min() < 0:
        raise FedrayError(f"{where}: row {int(np.argmin(labels))}: negative label {labels.min()}")
    client = table.column("client_id")
    if not (pa.types.is_integer(client.type) or _is_string(client.type) or pa.types.is_null(client.type)):
        raise FedrayError(f"{where}: column 'client_id' must be int or string, got {client.type}")
    is_train = pc.equal(split, TRAIN).to_numpy(zero_copy_only=False)
    no_client = client.is_null().to_numpy(zero_copy_only=False)
    if (is_train & no_client).any():
        raise FedrayError(f"{where}: row {int(np.argmax(is_train & no_client))}: train row without client_id")
    num_classes = _num_classes(where, labels, metadata or {})
    client_ids = pc.if_else(pa.array(is_train), client.cast(pa.string()), pa.scalar(None, pa.string()))
    return split_table(client_ids, np.arange(table.num_rows), labels, split), num_classes


def _is_string(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _num_classes(where: str, labels: np.ndarray, metadata: dict) -> int:
    try:
        num_classes = int(metadata[NUM_CLASSES_KEY]) if NUM_CLASSES_KEY in metadata else int(labels.max()) + 1
    except ValueError:
        raise FedrayError(f"{where}: schema metadata fedray.num_classes must be an integer, got {metadata[NUM_CLASSES_KEY]!r}") from None
    if labels.max() >= num_classes:
        raise FedrayError(f"{where}: row {int(np.argmax(labels))}: label {labels.max()} out of range for {num_classes} classes")
    if NUM_CLASSES_KEY not in metadata:
        _check_implicit_class_count(where, labels)
    return num_classes


def _check_implicit_class_count(where: str, labels: np.ndarray) -> None:
    """Refuse C = max label + 1 far beyond the labels present (one label of 50,000,000 made shards of 17 GB)."""
    num_classes = int(labels.max()) + 1
    if num_classes <= LARGE_IMPLICIT_CLASSES:
        return
    present = len(np.unique(labels))
    if num_classes > SPARSE_LABELS_FACTOR * present:
        raise FedrayError(
            f"{where}: row {int(np.argmax(labels))}: label {num_classes - 1} makes C = max label + 1 = {num_classes:,} classes "
            f"but only {present:,} distinct labels are present; relabel them 0..{present - 1}, or set the schema "
            f"metadata {NUM_CLASSES_KEY.decode()} to keep this C"
        )


def feature_dim(where: str, kind: pa.DataType, first_row: Callable[[], pa.Array]) -> int:
    """d from the features column's type ``kind`` (fixed-size lists) or its first row (read only then), after checking
    that it is a list of floats."""
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
        raise FedrayError(f"{where}: column 'features' must be a list of floats, got {kind}")
    if not pa.types.is_floating(kind.value_type):
        raise FedrayError(f"{where}: column 'features' must hold floats, got {kind.value_type}")
    if pa.types.is_fixed_size_list(kind):
        dim = kind.list_size
    else:
        first = first_row()
        if first.null_count:
            raise FedrayError(f"{where}: column 'features' has null rows (row 0)")
        dim = len(first[0])
    if dim == 0:
        raise FedrayError(f"{where}: features are empty")
    return dim


def feature_matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A (rows, d) float32 view of a list / fixed-size-list column with equal lengths."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(array) == 0:
        return np.zeros((0, 0), dtype=np.float32)
    values = array.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return values.reshape(len(array), -1)


def checked_features(column: pa.Array, ids: np.ndarray, dim: int, where: str) -> np.ndarray:
    """The (rows, dim) float32 matrix of ``column`` (rows ``ids``), refusing nulls, other lengths, NaN and inf."""
    if column.null_count:
        row = ids[int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))]
        raise FedrayError(f"{where}: column 'features' has null rows (row {row})")
    if not pa.types.is_fixed_size_list(column.type):
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        if (lengths != dim).any():
            at = int(np.argmax(lengths != dim))
            raise FedrayError(f"{where}: mixed feature lengths: row {ids[at]} has {lengths[at]}, row 0 has {dim}")
    block = feature_matrix(column)
    for start in range(0, len(block), FINITE_CHECK_ROWS):
        bad = ~np.isfinite(block[start:start + FINITE_CHECK_ROWS]).all(axis=1)
        if bad.any():
            raise FedrayError(f"{where}: NaN or inf in the features of row {ids[start + int(np.argmax(bad))]}")
    return block


@dataclass(frozen=True, eq=False)
class MatrixFeatures:
    """Features held in memory: row ``i`` of ``matrix`` (float32, samples × d) is sample id ``i``'s, whatever its split."""

    matrix: np.ndarray

    @property
    def dim(self) -> int:
        return self.matrix.shape[1]

    def features(self, split: str, sample_ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.matrix[np.asarray(sample_ids, dtype=np.int64)])


def table_federation(table: object, name: str, num_classes: int | None = None) -> Federation:
    """The federation of a pyarrow Table or polars DataFrame in the schema above, its features held in memory."""
    table = _arrow_table(table, name)
    check_columns(name, table.column_names)
    metadata = dict(table.schema.metadata or {})
    if num_classes is not None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
            raise FedrayError(f"{name}: num_classes must be an integer ≥ 1, got {num_classes!r}")
        metadata[NUM_CLASSES_KEY] = str(int(num_classes)).encode()
    rows, classes = split_rows(table, name, metadata)
    column = table.column("features").combine_chunks()
    dim = feature_dim(name, column.type, lambda: column.slice(0, 1))
    matrix = checked_features(column, np.arange(len(column)), dim, name)
    return Federation(name, classes, rows, MatrixFeatures(matrix))


def _arrow_table(table: object, name: str) -> pa.Table:
    """``table`` as a pyarrow Table: one already, a polars DataFrame, or anything ``pyarrow.table`` takes (a pandas
    DataFrame, a dict of columns)."""
    if isinstance(table, pa.Table):
        return table
    try:
        return table.to_arrow() if callable(getattr(table, "to_arrow", None)) else pa.table(table)
    except (TypeError, ValueError, pa.ArrowException) as error:
        raise FedrayError(f"{name}: expected a pyarrow Table or polars DataFrame, got {type(table).__name__} "
                          f"({_first_line(error)})") from None


def arrays_federation(features: object, labels: object, clients: object, split: object, num_classes: int | None = None,
                      name: str = "from_arrays") -> Federation:
    """The federation of one row per sample given as arrays (numpy, torch or lists): the same rows as a table, the same
    checks and the same federation as :func:`table_federation`."""
    given = {"features": features, "labels": labels, "clients": clients, "split": split}
    lengths = {argument: _length(name, argument, values) for argument, values in given.items()}
    if len(set(lengths.values())) > 1:
        counts = ", ".join(f"{argument} {count}" for argument, count in lengths.items())
        raise FedrayError(f"{name}: one row per sample, but the lengths differ: {counts}")
    columns = {"client_id": clients, "split": split, "label": labels}
    arrays = {column: _arrow_column(name, column, values) for column, values in columns.items()}
    arrays["features"] = _feature_column(name, features)
    return table_federation(pa.table(arrays), name, num_classes)


def _length(name: str, column: str, values: object) -> int:
    try:
        return len(values)
    except TypeError:
        raise FedrayError(f"{name}: {column} must hold one value per sample, got {type(values).__name__}") from None


def _numpy(values: object) -> object:
    """A torch tensor as a numpy array (on the CPU, detached); anything else unchanged."""
    is_tensor = "torch" in sys.modules and isinstance(values, sys.modules["torch"].Tensor)  # no tensor without torch
    return values.detach().cpu().numpy() if is_tensor else values


def _arrow_column(name: str, column: str, values: object) -> pa.Array:
    try:
        return pa.array(_numpy(values))
    except (TypeError, ValueError, pa.ArrowException) as error:
        raise FedrayError(f"{name}: column {column!r}: {_first_line(error)}") from None


def _feature_column(name: str, features: object) -> pa.Array:
    """``features`` as a fixed-size-list column (a 2-D array, copied: the federation does not change with the caller's
    array) or, from Python lists of rows, a list column (so that rows of other lengths are named as in a file)."""
    if isinstance(features, (list, tuple)):
        return _arrow_column(name, "features", list(features))
    matrix = np.array(_numpy(features))
    if matrix.ndim != 2:
        raise FedrayError(f"{name}: features must be a 2-D array (samples × d), got shape {matrix.shape}")
    if matrix.shape[1] == 0:
        raise FedrayError(f"{name}: features are empty")
    return pa.FixedSizeListArray.from_arrays(_arrow_column(name, "features", matrix.reshape(-1)), matrix.shape[1])


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
