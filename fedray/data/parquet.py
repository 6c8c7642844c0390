"""Bring-your-own features: Parquet file(s) of (client_id, split, label, features) rows.

Schema (one row per sample):
  client_id  int or string, null for test rows
  split      string, "train" or "test"
  label      integer ≥ 0
  features   list<float32> or fixed_size_list<float32>[d], the same length d in every row
The optional schema metadata key ``fedray.num_classes`` fixes C (else max label + 1, refused when
that is over 100,000 and over 10 × the distinct labels present: a stray label would size every
class statistic and the classifier).
Several files (a feature cache's parts) are read as one table, in the order given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from fedray.data.federation import TEST, TRAIN, Federation, split_table
from fedray.errors import FedrayError

REQUIRED = ("client_id", "split", "label", "features")
NUM_CLASSES_KEY = b"fedray.num_classes"
VALIDATE_ROWS = 65_536
LARGE_IMPLICIT_CLASSES = 100_000
SPARSE_LABELS_FACTOR = 10
"""C = max label + 1 is refused when above both: a class count only metadata may set."""


def feature_matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A (rows, d) float32 view of a list / fixed-size-list column with equal lengths."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(array) == 0:
        return np.zeros((0, 0), dtype=np.float32)
    values = array.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return values.reshape(len(array), -1)


@dataclass
class ParquetFeatures:
    """Features read from the file(s) by row number (the sample_id)."""

    paths: list[str]
    dim: int
    _column: pa.ChunkedArray | None = field(default=None, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_column": None}

    def features(self, split: str, sample_ids: np.ndarray) -> torch.Tensor:
        if self._column is None:
            self._column = read_files(self.paths, columns=["features"]).column("features")
        return torch.from_numpy(feature_matrix(self._column.take(pa.array(sample_ids))).copy())


def _check_features(path: Path, column: pa.ChunkedArray) -> int:
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type)):
        raise FedrayError(f"{path}: column 'features' must be a list of floats, got {column.type}")
    if not pa.types.is_floating(column.type.value_type):
        raise FedrayError(f"{path}: column 'features' must hold floats, got {column.type.value_type}")
    if column.null_count:
        raise FedrayError(f"{path}: column 'features' has null rows")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    if len(lengths) and lengths.min() != lengths.max():
        row = int(np.argmax(lengths != lengths[0]))
        raise FedrayError(f"{path}: mixed feature lengths: row {row} has {lengths[row]}, row 0 has {lengths[0]}")
    dim = int(lengths[0]) if len(lengths) else 0
    if dim == 0:
        raise FedrayError(f"{path}: features are empty")
    for start in range(0, len(column), VALIDATE_ROWS):
        block = feature_matrix(column.slice(start, VALIDATE_ROWS))
        bad = ~np.isfinite(block).all(axis=1)
        if bad.any():
            raise FedrayError(f"{path}: NaN or inf in the features of row {start + int(np.argmax(bad))}")
    return dim


def _check_implicit_class_count(path: Path, labels: np.ndarray) -> None:
    """Refuse C = max label + 1 far beyond the labels present (one label of 50,000,000 made shards of 17 GB)."""
    num_classes = int(labels.max()) + 1
    if num_classes <= LARGE_IMPLICIT_CLASSES:
        return
    present = len(np.unique(labels))
    if num_classes > SPARSE_LABELS_FACTOR * present:
        raise FedrayError(
            f"{path}: row {int(np.argmax(labels))}: label {num_classes - 1} makes C = max label + 1 = {num_classes:,} classes "
            f"but only {present:,} distinct labels are present; relabel them 0..{present - 1}, or set the schema "
            f"metadata {NUM_CLASSES_KEY.decode()} to keep this C"
        )


def read_files(paths: list[str], columns: list[str] | None = None) -> pa.Table:
    """The files' rows, concatenated zero-copy from memory maps."""
    return pa.concat_tables([pq.read_table(path, columns=columns, memory_map=True) for path in paths])


def load_parquet(path: str | Path, parts: list[Path] | None = None, name: str | None = None) -> Federation:
    """The federation in the Parquet file ``path``, or in the files ``parts`` (``path`` names them in errors)."""
    path = Path(path)
    files = [str(part) for part in parts] if parts is not None else [str(path)]
    if parts is None and not path.is_file():
        raise FedrayError(f"{path}: no such file")
    try:
        table = read_files(files)
    except (pa.ArrowInvalid, OSError) as error:
        raise FedrayError(f"{path}: not a readable Parquet file ({error})") from None
    missing = [name for name in REQUIRED if name not in table.column_names]
    if missing:
        raise FedrayError(f"{path}: missing column(s) {', '.join(missing)}; expected {', '.join(REQUIRED)}")
    if table.num_rows == 0:
        raise FedrayError(f"{path}: the file has no rows")
    split = table.column("split")
    if not (pa.types.is_string(split.type) or pa.types.is_large_string(split.type) or pa.types.is_dictionary(split.type)):
        raise FedrayError(f"{path}: column 'split' must be strings 'train'/'test', got {split.type}")
    split = split.cast(pa.string())
    bad_split = pc.invert(pc.is_in(split, pa.array([TRAIN, TEST]))).fill_null(True)
    if pc.any(bad_split).as_py():
        row = int(np.argmax(bad_split.to_numpy(zero_copy_only=False)))
        raise FedrayError(f"{path}: row {row}: split must be 'train' or 'test', got {split[row].as_py()!r}")
    label = table.column("label")
    if not pa.types.is_integer(label.type):
        raise FedrayError(f"{path}: column 'label' must be integers, got {label.type}")
    if label.null_count:
        raise FedrayError(f"{path}: column 'label' has nulls")
    labels = label.to_numpy()
    if labels.min() < 0:
        raise FedrayError(f"{path}: row {int(np.argmin(labels))}: negative label {labels.min()}")
    client = table.column("client_id")
    if not (pa.types.is_integer(client.type) or pa.types.is_string(client.type) or pa.types.is_large_string(client.type) or pa.types.is_null(client.type)):
        raise FedrayError(f"{path}: column 'client_id' must be int or string, got {client.type}")
    is_train = pc.equal(split, TRAIN).to_numpy(zero_copy_only=False)
    no_client = client.is_null().to_numpy(zero_copy_only=False)
    if (is_train & no_client).any():
        raise FedrayError(f"{path}: row {int(np.argmax(is_train & no_client))}: train row without client_id")
    dim = _check_features(path, table.column("features"))
    metadata = table.schema.metadata or {}
    try:
        num_classes = int(metadata[NUM_CLASSES_KEY]) if NUM_CLASSES_KEY in metadata else int(labels.max()) + 1
    except ValueError:
        raise FedrayError(f"{path}: schema metadata fedray.num_classes must be an integer, got {metadata[NUM_CLASSES_KEY]!r}") from None
    if labels.max() >= num_classes:
        raise FedrayError(f"{path}: row {int(np.argmax(labels))}: label {labels.max()} out of range for {num_classes} classes")
    if NUM_CLASSES_KEY not in metadata:
        _check_implicit_class_count(path, labels)
    client_ids = pc.if_else(pa.array(is_train), client.cast(pa.string()), pa.scalar(None, pa.string()))
    rows = split_table(client_ids, np.arange(table.num_rows), labels, split)
    return Federation(name or f"parquet:{path}", num_classes, rows, ParquetFeatures(files, dim))
