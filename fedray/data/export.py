"""Write any federation, features included, in the bring-your-own Parquet schema: one file, or a directory of parts.

A directory (``--partition-size N``) is written by streaming: a few clients'
rows at a time (:meth:`Federation.train_arrays`, the feature source), never
the whole federation's features, so it scales to populations whose features
fit no process. Its parts are cut at client boundaries (a client's rows in one
part) and each part's row groups too, so a shard reading some clients opens
only the parts, and reads only the row groups, that hold them.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fedray.core.errors import FedrayError
from fedray.core.federation import TEST, TRAIN, Federation
from fedray.core.full_disk import full_disk_code, full_disk_error
from fedray.core.schema import NUM_CLASSES_KEY
from fedray.core.results import TEMPORARY_TAG, remove_stale_temporaries, write_atomically

ROWS_PER_BATCH = 16_384
"""Rows written at a time to one file; also the most rows of a directory part's row group (unless one client has more)."""
PART_NAME = "part-{:05d}.parquet"
PART_PATTERN = re.compile(r"part-\d{5}\.parquet")
"""The names of a directory's parts, read in their (sorted) order."""


def schema(federation: Federation) -> pa.Schema:
    return pa.schema(
        [("client_id", pa.string()), ("split", pa.string()), ("label", pa.int32()),
         ("features", pa.list_(pa.float32(), federation.dim))],
        metadata={NUM_CLASSES_KEY: str(federation.num_classes).encode()},
    )


def _batch(federation: Federation, split: str, client_ids: pa.Array, labels: np.ndarray, sample_ids: np.ndarray,
           columns: pa.Schema) -> pa.RecordBatch:
    features = federation.require_features().features(split, sample_ids).numpy()
    return pa.record_batch(
        {
            "client_id": client_ids,
            "split": pa.array([split] * len(sample_ids), pa.string()),
            "label": pa.array(labels, pa.int32()),
            "features": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel(), pa.float32()), federation.dim),
        }
    ).cast(columns)


def _writer(path: Path, columns: pa.Schema) -> pq.ParquetWriter:
    # Features written plain: a dictionary of floats that rarely repeat only grows the file (by a quarter at d = 64).
    return pq.ParquetWriter(path, columns, use_dictionary=["client_id", "split", "label"])


def export_parquet(federation: Federation, out: Path) -> None:
    """The whole federation in one file, which appears only once written in full (a full disk: one line, no file)."""
    columns = schema(federation)

    def write(path: Path) -> None:
        with _writer(path, columns) as writer:
            for split, table in ((TRAIN, federation.train), (TEST, federation.test)):
                for start in range(0, table.num_rows, ROWS_PER_BATCH):
                    rows = table.slice(start, ROWS_PER_BATCH)
                    writer.write_batch(_batch(federation, split, rows.column("client_id").combine_chunks(),
                                              rows.column("label").to_numpy(), rows.column("sample_id").to_numpy(), columns))

    remove_stale_temporaries(out.parent, [out.name])
    write_atomically(out, write, estimated_bytes(federation))


def cuts(offsets: np.ndarray, first: int, end: int, rows: int) -> list[int]:
    """Client boundaries from ``first`` to ``end``: each piece the most clients holding at most ``rows`` rows
    (``offsets``: the clients' row offsets), one client at least."""
    bounds = [first]
    while bounds[-1] < end:
        start = bounds[-1]
        bounds.append(min(end, max(start + 1, int(np.searchsorted(offsets, offsets[start] + rows, side="right")) - 1)))
    return bounds


def check_directory_out(out: Path, partition_size: int) -> None:
    """Refuse, before any work, a bad ``--partition-size`` or an ``out`` that is a file or a folder holding anything
    but a previous export's parts (which the export replaces)."""
    if partition_size < 1:
        raise FedrayError(f"--partition-size must be ≥ 1 sample, got {partition_size}")
    if out.is_file():
        raise FedrayError(f"--out {out}: is a file; --partition-size writes a directory of parts")
    if out.is_dir():
        others = sorted(entry.name for entry in out.iterdir() if not PART_PATTERN.fullmatch(entry.name))
        if others:
            raise FedrayError(f"--out {out}: holds {others[0]}, not a Parquet export's part; name a new or an exported directory")


def export_parquet_directory(federation: Federation, out: Path, partition_size: int) -> None:
    """The federation in parts of about ``partition_size`` samples: training parts cut at client boundaries (row
    groups too, of at most :data:`ROWS_PER_BATCH` rows unless a client has more), then the test rows' parts. The
    directory appears only once written in full, in place of a previous one (a full disk: one line, no directory)."""
    check_directory_out(out, partition_size)
    columns = schema(federation)
    offsets, client_ids = federation.client_offsets, np.asarray(federation.client_ids, dtype=object)

    def train_part(path: Path, first: int, end: int) -> None:
        with _writer(path, columns) as writer:
            for start, stop in zip(*_pairs(cuts(offsets, first, end, ROWS_PER_BATCH))):
                sample_ids, labels, local = federation.train_arrays(start, stop)
                owners = pa.array(np.repeat(client_ids[start:stop], np.diff(local)), pa.string())
                writer.write_table(pa.Table.from_batches([_batch(federation, TRAIN, owners, labels, sample_ids, columns)]))

    def test_part(path: Path, start: int, stop: int) -> None:
        sample_ids, labels = (column[start:stop] for column in federation.test_arrays())
        with _writer(path, columns) as writer:
            for first in range(0, len(sample_ids), ROWS_PER_BATCH):
                rows = slice(first, first + ROWS_PER_BATCH)
                owners = pa.nulls(len(sample_ids[rows]), pa.string())
                writer.write_table(pa.Table.from_batches([_batch(federation, TEST, owners, labels[rows], sample_ids[rows],
                                                                 columns)]))

    def write(folder: Path) -> None:
        tests = len(federation.test_arrays()[0])
        parts: list[tuple[Callable[[Path, int, int], None], int, int]] = [
            *((train_part, a, b) for a, b in zip(*_pairs(cuts(offsets, 0, federation.num_clients, partition_size)))),
            *((test_part, a, min(a + partition_size, tests)) for a in range(0, tests, partition_size))]
        for number, (part, start, stop) in enumerate(parts):
            part(folder / PART_NAME.format(number), start, stop)

    write_directory_atomically(out, write, estimated_bytes(federation))


def _pairs(bounds: list[int]) -> tuple[list[int], list[int]]:
    return bounds[:-1], bounds[1:]


def write_directory_atomically(out: Path, write: Callable[[Path], None], size: int) -> None:
    """Fill a temporary directory ``.NAME.TAG.tmp`` beside ``out`` with ``write``, then rename it to ``out`` (a previous
    ``out`` moved aside first, removed last). On any failure the temporary goes and ``out`` is as it was; a full disk is
    one line saying ``size`` (an estimate of the bytes written) and the space free."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stale = re.compile(rf"\.{re.escape(out.name)}\.{TEMPORARY_TAG}\.tmp")
    for entry in out.parent.iterdir():
        if stale.fullmatch(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    temporary = None
    try:
        temporary = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        write(temporary)
        aside = None
        if out.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
            os.replace(out, aside)
        try:
            os.replace(temporary, out)
        except BaseException:
            if aside is not None:
                os.replace(aside, out)
            raise
        if aside is not None:
            shutil.rmtree(aside)
    except BaseException as error:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
        code = full_disk_code(error)
        if code is not None:
            raise full_disk_error(code, out, out.parent, [size]) from None
        raise


def estimated_bytes(federation: Federation) -> int:
    """About the exported file's size (a little over it), for the disk-full message: 4 bytes for each feature and
    the label of every row; the dictionary-encoded client ids, splits and labels take less."""
    return (int(federation.client_offsets[-1]) + len(federation.test_arrays()[0])) * 4 * (federation.dim + 1)
