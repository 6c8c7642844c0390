"""The feature cache: one folder per (dataset, backbone, weights, transform, precision).

Layout of an entry ``CACHE_DIR/<dataset>--<backbone>--<hash>/``:
  key.json                 what the hash was computed from (written first)
  parts/<split>-NNNNN.parquet
                           the features of one fixed block of PART_ROWS samples of a
                           split (rows in sample order), each written atomically, so
                           an interrupted extraction resumes from the finished parts
  manifest.json            written last: the entry is complete (its dim, C, rows, and
                           backbone_macs: the backbone's forward multiply-adds per image, F_φ)
A part has the columns ``sample_id, client_id, split, label, image_id,
features`` (fixed-size list of float32); its schema metadata holds C
(``fedray.num_classes``, read by the Parquet loader) and the samples it skipped
(``fedray.skipped``: JSON [[sample_id, reason], ...]).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fedray.data.parquet import read_files
from fedray.core.schema import feature_matrix
from fedray.core.errors import FedrayError
from fedray.core.results import remove_stale_temporaries, write_atomically

PART_ROWS = 256
KEY, MANIFEST, PARTS = "key.json", "manifest.json", "parts"
NUM_CLASSES_KEY, SKIPPED_KEY = b"fedray.num_classes", b"fedray.skipped"


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[-60:]


@dataclass(frozen=True)
class CacheEntry:
    path: Path

    @classmethod
    def for_key(cls, root: Path, key: dict) -> "CacheEntry":
        name = f"{_slug(Path(key['dataset'].split(':', 1)[-1].split('?')[0]).name)}--{key['backbone']}--{key_hash(key)}"
        return cls(root / name)

    @property
    def complete(self) -> bool:
        """Whether the manifest is there (False where it cannot even be looked for: a folder that may not be searched)."""
        try:
            return (self.path / MANIFEST).is_file()
        except PermissionError:
            return False

    def part_path(self, split: str, index: int) -> Path:
        return self.path / PARTS / f"{split}-{index:05d}.parquet"

    def start(self, key: dict) -> None:
        """Create the entry, or check that an unfinished one was started with the same key."""
        key_file = self.path / KEY
        if key_file.is_file():
            if json.loads(key_file.read_text()) != json.loads(json.dumps(key)):
                raise FedrayError(f"{self.path}: holds features of another configuration (see {KEY})")
            return
        write_atomically(key_file, lambda p: p.write_text(json.dumps(key, indent=2, sort_keys=True)))

    def write_part(self, split: str, index: int, rows: pa.Table, num_classes: int, skipped: list[tuple[int, str]]) -> None:
        metadata = {NUM_CLASSES_KEY: str(num_classes).encode(), SKIPPED_KEY: json.dumps(skipped).encode()}
        table = rows.replace_schema_metadata(metadata)
        write_atomically(self.part_path(split, index), lambda p: pq.write_table(table, p))

    def part_files(self) -> list[Path]:
        return sorted((self.path / PARTS).glob("*.parquet"))

    def rows(self) -> pa.Table:
        """Every finished part's rows, in part order."""
        return read_files([str(part) for part in self.part_files()])

    def features(self) -> np.ndarray:
        """The (rows, d) float32 features of :meth:`rows`."""
        return feature_matrix(self.rows().column("features"))

    def skipped(self) -> list[tuple[int, str]]:
        """Every (sample_id, reason) the finished parts skipped."""
        found = []
        for part in self.part_files():
            found += [tuple(item) for item in json.loads(pq.read_schema(part).metadata[SKIPPED_KEY])]
        return found

    def remove_stale_temporaries(self, part_names: list[str]) -> None:
        """Remove what interrupted writes of the entry's files (``part_names`` in parts/) left behind."""
        remove_stale_temporaries(self.path, [KEY, MANIFEST])
        remove_stale_temporaries(self.path / PARTS, part_names)

    def finish(self, manifest: dict) -> None:
        write_atomically(self.path / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=2)))

    def manifest(self) -> dict:
        return json.loads((self.path / MANIFEST).read_text())


def part_rows(table: pa.Table, split: str) -> list[pa.Table]:
    """The rows of ``split`` in sample order, cut into blocks of PART_ROWS: the parts' fixed contents."""
    rows = table.filter(pc.equal(table.column("split"), split))
    rows = rows.take(pc.sort_indices(rows.column("sample_id")))
    return [rows.slice(start, PART_ROWS) for start in range(0, rows.num_rows, PART_ROWS)]


def find_entry(path: str | Path) -> CacheEntry:
    """The complete entry at ``path``, or the only complete entry in the cache folder ``path``."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return CacheEntry(path)
    if (path / KEY).is_file():
        raise FedrayError(f"{path}: unfinished feature extraction (run fedray extract again to resume)")
    if not path.is_dir():
        raise FedrayError(f"{path}: no such feature cache")
    entries = sorted(p for p in path.iterdir() if (p / MANIFEST).is_file())
    if len(entries) != 1:
        names = ", ".join(p.name for p in entries) or "none"
        raise FedrayError(f"{path}: holds {len(entries)} complete feature caches ({names}); name one: features:{path}/NAME")
    return CacheEntry(entries[0])


def features_table(sample_ids: np.ndarray, rows: pa.Table, features: np.ndarray) -> pa.Table:
    """A part's table: the kept rows' columns plus their (n, d) float32 features."""
    dim = features.shape[1]
    column = pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1), pa.float32()), dim)
    keep = pa.array(np.searchsorted(rows.column("sample_id").to_numpy(), sample_ids))
    kept = rows.take(keep)
    columns = {name: kept.column(name) for name in ("sample_id", "client_id", "split", "label")}
    if "image_id" in kept.column_names:
        columns["image_id"] = kept.column("image_id")
    return pa.table({**columns, "features": column})
