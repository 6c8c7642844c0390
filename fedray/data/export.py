"""Write any federation, features included, in the bring-your-own Parquet schema."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from fedray.core.federation import TEST, TRAIN, Federation
from fedray.core.schema import NUM_CLASSES_KEY
from fedray.core.results import remove_stale_temporaries, write_atomically

ROWS_PER_BATCH = 16_384


def _batch(federation: Federation, split: str, rows: pa.Table) -> pa.RecordBatch:
    features = federation.require_features().features(split, rows.column("sample_id").to_numpy()).numpy()
    return pa.record_batch(
        {
            "client_id": rows.column("client_id").combine_chunks(),
            "split": pa.array([split] * rows.num_rows, pa.string()),
            "label": rows.column("label").combine_chunks(),
            "features": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel(), pa.float32()), federation.dim),
        }
    )


def export_parquet(federation: Federation, out: Path) -> None:
    """The whole federation in one file, which appears only once written in full (a full disk: one line, no file)."""
    schema = pa.schema(
        [("client_id", pa.string()), ("split", pa.string()), ("label", pa.int32()),
         ("features", pa.list_(pa.float32(), federation.dim))],
        metadata={NUM_CLASSES_KEY: str(federation.num_classes).encode()},
    )

    def write(path: Path) -> None:
        # Features written plain: a dictionary of floats that rarely repeat only grows the file (by a quarter at d = 64).
        with pq.ParquetWriter(path, schema, use_dictionary=["client_id", "split", "label"]) as writer:
            for split, table in ((TRAIN, federation.train), (TEST, federation.test)):
                for start in range(0, table.num_rows, ROWS_PER_BATCH):
                    rows = table.slice(start, ROWS_PER_BATCH).select(["client_id", "label", "sample_id"])
                    writer.write_batch(_batch(federation, split, rows).cast(schema))

    remove_stale_temporaries(out.parent, [out.name])
    write_atomically(out, write, estimated_bytes(federation))


def estimated_bytes(federation: Federation) -> int:
    """About the exported file's size (a little over it), for the disk-full message: 4 bytes for each feature and
    the label of every row; the dictionary-encoded client ids, splits and labels take less."""
    return (federation.train.num_rows + federation.test.num_rows) * 4 * (federation.dim + 1)
