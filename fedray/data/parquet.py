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
Loading reads the client, split and label columns only; features are read, and
checked, by whoever needs some rows (:class:`ParquetFeatures`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from fedray.data.federation import TEST, TRAIN, Federation, split_table
from fedray.errors import FedrayError

REQUIRED = ("client_id", "split", "label", "features")
SPLIT_COLUMNS = ["client_id", "split", "label"]
"""What :func:`load_parquet` reads: the features stay in the file until a process needs some rows."""
NUM_CLASSES_KEY = b"fedray.num_classes"
LARGE_IMPLICIT_CLASSES = 100_000
SPARSE_LABELS_FACTOR = 10
"""C = max label + 1 is refused when above both: a class count only metadata may set."""
READ_BATCH = 4096
"""Rows decoded at a time when reading features."""


def feature_matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A (rows, d) float32 view of a list / fixed-size-list column with equal lengths."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(array) == 0:
        return np.zeros((0, 0), dtype=np.float32)
    values = array.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return values.reshape(len(array), -1)


@dataclass
class ParquetFeatures:
    """Features read from the file(s) by row number (the sample_id), one row group at a time.

    Only the row groups holding requested rows are read, and only their
    ``features`` column, so a shard reads its own clients' rows and the server
    its test rows. Rows are checked as they are read (no nulls, ``dim`` floats,
    all finite): a bad row stops whoever reads it with a one-line error naming
    ``name`` and the row. :meth:`check` reads and checks every row.
    """

    paths: list[str]
    dim: int
    name: str

    def features(self, split: str, sample_ids: np.ndarray) -> torch.Tensor:
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        out = np.empty((len(sample_ids), self.dim), dtype=np.float32)
        order = np.argsort(sample_ids, kind="stable")
        for positions, block in self._blocks(sample_ids[order]):
            out[order[positions]] = block
        return torch.from_numpy(out)

    def check(self) -> None:
        """Read and check every row (what a run checks as it goes, done at once: ``fedray data info``)."""
        for _ in self._blocks(None):
            pass

    def _blocks(self, rows: np.ndarray | None) -> Iterator[tuple[slice, np.ndarray]]:
        """For each batch of a row group holding some of the sorted file ``rows`` (all rows if None): their positions
        in ``rows`` and their features. Batches of :data:`READ_BATCH` rows keep a reader's memory to its own rows."""
        first = 0
        for path in self.paths:
            file = pq.ParquetFile(path, buffer_size=1 << 22, pre_buffer=False)
            for group in range(file.num_row_groups):
                count = file.metadata.row_group(group).num_rows
                if rows is None or np.searchsorted(rows, first + count) > np.searchsorted(rows, first):
                    for batch in file.iter_batches(READ_BATCH, row_groups=[group], columns=["features"]):
                        stop = first + batch.num_rows
                        lo, hi = (0, batch.num_rows) if rows is None else np.searchsorted(rows, [first, stop])
                        if hi > lo:
                            column = batch.column("features")
                            ids = np.arange(first, stop) if rows is None else rows[lo:hi]
                            if not np.array_equal(ids, np.arange(first, stop)):
                                column = column.take(pa.array(ids - first))
                            yield slice(lo, hi), self._checked(column, ids)
                        first = stop
                else:
                    first += count
        if rows is not None and len(rows) and rows[-1] >= first:
            raise FedrayError(f"{self.name}: no row {rows[-1]} (the file has {first})")

    def _checked(self, column: pa.Array, ids: np.ndarray) -> np.ndarray:
        """The (rows, dim) float32 matrix of ``column`` (rows ``ids`` of the file), refusing nulls, other lengths, NaN and inf."""
        if column.null_count:
            row = ids[int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))]
            raise FedrayError(f"{self.name}: column 'features' has null rows (row {row})")
        if not pa.types.is_fixed_size_list(column.type):
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
            if (lengths != self.dim).any():
                at = int(np.argmax(lengths != self.dim))
                raise FedrayError(f"{self.name}: mixed feature lengths: row {ids[at]} has {lengths[at]}, row 0 has {self.dim}")
        block = feature_matrix(column)
        bad = ~np.isfinite(block).all(axis=1)
        if bad.any():
            raise FedrayError(f"{self.name}: NaN or inf in the features of row {ids[int(np.argmax(bad))]}")
        return block


def _feature_dim(path: Path, files: list[str], schema: pa.Schema) -> int:
    """d from the schema (fixed-size lists) or from the first row, after checking the column's type."""
    kind = schema.field("features").type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
        raise FedrayError(f"{path}: column 'features' must be a list of floats, got {kind}")
    if not pa.types.is_floating(kind.value_type):
        raise FedrayError(f"{path}: column 'features' must hold floats, got {kind.value_type}")
    if pa.types.is_fixed_size_list(kind):
        dim = kind.list_size
    else:
        first = next(pq.ParquetFile(files[0], memory_map=True).iter_batches(batch_size=1, columns=["features"]))
        if first.column(0).null_count:
            raise FedrayError(f"{path}: column 'features' has null rows (row 0)")
        dim = len(first.column(0)[0])
    if dim == 0:
        raise FedrayError(f"{path}: features are empty")
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
        schema = pq.read_schema(files[0], memory_map=True)
        missing = [name for name in REQUIRED if name not in schema.names]
        if missing:
            raise FedrayError(f"{path}: missing column(s) {', '.join(missing)}; expected {', '.join(REQUIRED)}")
        table = read_files(files, SPLIT_COLUMNS)
    except (pa.ArrowInvalid, OSError) as error:
        raise FedrayError(f"{path}: not a readable Parquet file ({error})") from None
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
    dim = _feature_dim(path, files, schema)
    metadata = schema.metadata or {}
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
    spec = None if parts is not None else f"parquet:{path.resolve()}"
    return Federation(name or f"parquet:{path}", num_classes, rows, ParquetFeatures(files, dim, str(path)), spec=spec)
