"""Bring-your-own features: Parquet file(s) of (client_id, split, label, features) rows.

The schema and its checks are :mod:`fedray.core.schema`'s (the same as for rows given from Python).
Several files (a feature cache's parts, a directory's parts) are read as one table, in the order given.
Loading reads the client, split and label columns only; features are read, and
checked, by whoever needs some rows (:class:`ParquetFeatures`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fedray.core.lazy_modules import lazy_module
from fedray.core.federation import Federation
from fedray.core.schema import check_columns, checked_features, feature_dim, split_rows
from fedray.core.errors import FedrayError
from fedray.data.export import PART_PATTERN

torch = lazy_module("torch", globals())

SPLIT_COLUMNS = ["client_id", "split", "label"]
"""What :func:`load_parquet` reads: the features stay in the file until a process needs some rows."""
READ_BATCH = 4096
"""Rows decoded at a time when reading features."""


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
    file_rows: list[int] | None = None
    """Rows in each file, when known (a directory's parts): a file holding no requested row is then not even opened."""

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
        for number, path in enumerate(self.paths):
            if rows is not None and self.file_rows is not None and not _any_in(rows, first, first + self.file_rows[number]):
                first += self.file_rows[number]
                continue
            with arrow_errors(path):
                file = pq.ParquetFile(path, buffer_size=1 << 22, pre_buffer=False)
                for group in range(file.num_row_groups):
                    count = file.metadata.row_group(group).num_rows
                    if rows is None or _any_in(rows, first, first + count):
                        for batch in file.iter_batches(READ_BATCH, row_groups=[group], columns=["features"]):
                            stop = first + batch.num_rows
                            lo, hi = (0, batch.num_rows) if rows is None else np.searchsorted(rows, [first, stop])
                            if hi > lo:
                                column = batch.column("features")
                                ids = np.arange(first, stop) if rows is None else rows[lo:hi]
                                if not np.array_equal(ids, np.arange(first, stop)):
                                    column = column.take(pa.array(ids - first))
                                yield slice(lo, hi), checked_features(column, ids, self.dim, self.name)
                            first = stop
                    else:
                        first += count
        if rows is not None and len(rows) and rows[-1] >= first:
            raise FedrayError(f"{self.name}: no row {rows[-1]} (the file has {first})")


def _any_in(rows: np.ndarray, start: int, stop: int) -> bool:
    """Whether the sorted ``rows`` hold one in ``start .. stop-1``."""
    return bool(np.searchsorted(rows, stop) > np.searchsorted(rows, start))


def read_files(paths: list[str], columns: list[str] | None = None) -> pa.Table:
    """The files' rows, concatenated zero-copy from memory maps."""
    return pa.concat_tables([pq.read_table(path, columns=columns, memory_map=True) for path in paths])


def load_parquet(path: str | Path, parts: list[Path] | None = None, name: str | None = None) -> Federation:
    """The federation in the Parquet file ``path``, or in the files ``parts`` (``path`` names them in errors), or in
    the directory ``path`` (see :func:`load_parquet_directory`)."""
    path = Path(path)
    if parts is None and path.is_dir():
        return load_parquet_directory(path)
    files = [str(part) for part in parts] if parts is not None else [str(path)]
    if parts is None and not path.is_file():
        raise FedrayError(f"{path}: no such file")
    with arrow_errors(path):
        schema = pq.read_schema(files[0], memory_map=True)
        check_columns(str(path), schema.names)
        table = read_files(files, SPLIT_COLUMNS)
    rows, num_classes = split_rows(table, str(path), schema.metadata)
    dim = feature_dim(str(path), schema.field("features").type, lambda: _first_row(files[0]))
    spec = None if parts is not None else f"parquet:{path.resolve()}"
    return Federation(name or f"parquet:{path}", num_classes, rows, ParquetFeatures(files, dim, str(path)), spec=spec)


def _first_row(path: str) -> pa.Array:
    return next(pq.ParquetFile(path, memory_map=True).iter_batches(batch_size=1, columns=["features"])).column(0)


def load_parquet_directory(path: Path) -> Federation:
    """The federation in the parts ``part-NNNNN.parquet`` of the directory ``path`` (as ``fedray data export
    --partition-size`` writes them), read in their order: their client, split and label columns and their row counts,
    never their features. Every part has the first one's schema and feature length (from its type, or its first row),
    checked before any part's rows are read, and each client's rows are in one part, so a shard opens only the parts
    of its clients. A part Arrow cannot read is named, with Arrow's message on one line."""
    files = sorted(entry for entry in path.iterdir() if PART_PATTERN.fullmatch(entry.name))
    if not files:
        raise FedrayError(f"{path}: a directory without parts (part-00000.parquet, ...)")
    with arrow_errors(files[0]):
        schema = pq.read_schema(files[0], memory_map=True)
        check_columns(str(path), schema.names)
        dim = feature_dim(str(files[0]), schema.field("features").type, lambda: _first_row(str(files[0])))
    for file in files[1:]:
        with arrow_errors(file):
            other = pq.read_schema(file, memory_map=True)
            length = feature_dim(str(file), other.field("features").type, lambda: _first_row(str(file))) \
                if other.names == schema.names else dim
        if length != dim:
            raise FedrayError(f"{file}: features of {length} floats, where {files[0].name}'s have {dim}: every part "
                              f"of a Parquet directory holds features of one length")
        if not other.equals(schema, check_metadata=True):
            raise FedrayError(f"{file}: another schema than {files[0].name}'s ({_schema_text(other)} vs "
                              f"{_schema_text(schema)})")
    tables = []
    for file in files:
        with arrow_errors(file):
            tables.append(pq.read_table(file, columns=SPLIT_COLUMNS, memory_map=True))
    _check_clients_in_one_part(files, tables)
    rows, num_classes = split_rows(pa.concat_tables(tables), str(path), schema.metadata)
    source = ParquetFeatures([str(file) for file in files], dim, str(path), [table.num_rows for table in tables])
    return Federation(f"parquet:{path}", num_classes, rows, source, spec=f"parquet:{path.resolve()}")


@contextmanager
def arrow_errors(file: Path | str) -> Iterator[None]:
    """Arrow's failures to read ``file`` as a one-line error naming it, with Arrow's message on one line."""
    try:
        yield
    except (pa.ArrowException, OSError) as error:
        raise FedrayError(f"{file}: not a readable Parquet file ({' '.join(str(error).split())})") from None


def _schema_text(schema: pa.Schema) -> str:
    return ", ".join(f"{field.name}: {field.type}" for field in schema) + (f" {dict(schema.metadata)}" if schema.metadata else "")


def _check_clients_in_one_part(files: list[Path], tables: list[pa.Table]) -> None:
    """A client whose rows are in two parts is refused, naming it and both parts."""
    seen: dict[str, int] = {}
    for number, table in enumerate(tables):
        clients = pc.unique(table.column("client_id").drop_null().cast(pa.string())).to_pylist()
        for client in clients:
            if seen.setdefault(client, number) != number:
                raise FedrayError(f"client {client!r} is split across {files[seen[client]]} and {files[number].name}: "
                                  f"a Parquet directory keeps each client's rows in one part")
