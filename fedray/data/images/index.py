"""Where each image of a split lives: ``image_id`` → file path under an image root.

Layouts:
  walk   any tree whose file names are ``<image_id>.<ext>`` (iNaturalist 2017:
         ``train_val_images/<super>/<species>/<image_id>.jpg``); the root is
         walked once and the index cached as Parquet under the fedray cache
         folder ($FEDRAY_CACHE_DIR, default ~/.cache/fedray), keyed by the root.
  gldv2  Google Landmarks v2: ``<a>/<b>/<c>/<image_id>.jpg`` with a, b, c the
         first three characters of the id; computed, no walk.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fedray.core.errors import FedrayError
from fedray.core.results import write_atomically

LAYOUTS = ("walk", "gldv2")
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"})


def cache_home() -> Path:
    return Path(os.environ.get("FEDRAY_CACHE_DIR") or Path.home() / ".cache" / "fedray")


def image_files(root: Path) -> list[Path]:
    """Every image file under ``root`` (by extension), in sorted order."""
    found = [
        Path(folder) / name
        for folder, _, names in os.walk(root)
        for name in names
        if Path(name).suffix.lower() in IMAGE_EXTENSIONS
    ]
    return sorted(found)


def walked_index(root: Path) -> pa.Table:
    """``image_id, path`` (path relative to ``root``) of every image under ``root``; built once, then read from the cache."""
    cached = cache_home() / "image-index" / f"{hashlib.sha256(str(root).encode()).hexdigest()[:16]}.parquet"
    if cached.is_file():
        return pq.read_table(cached)
    files = image_files(root)
    if not files:
        raise FedrayError(f"{root}: no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})")
    index = pa.table({"image_id": [f.stem for f in files], "path": [str(f.relative_to(root)) for f in files]})
    counts = pc.value_counts(index.column("image_id"))
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(repeated):
        image_id = repeated[0]["values"].as_py()
        paths = index.filter(pc.equal(index.column("image_id"), image_id)).column("path").to_pylist()
        raise FedrayError(f"{root}: image id {image_id!r} names several files: {', '.join(paths[:3])}")
    write_atomically(cached, lambda path: pq.write_table(index, path))
    return index


def resolve_paths(root: str | Path, image_ids: pa.Array, layout: str) -> pa.Array:
    """Absolute path of each image id (null where no file is known; missing files are counted later)."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise FedrayError(f"{root}: image root is not a folder")
    if layout == "gldv2":
        ids = image_ids.to_pylist()
        return pa.array([str(root / i[0] / i[1] / i[2] / f"{i}.jpg") if len(i) >= 3 else None for i in ids], pa.string())
    if layout != "walk":
        raise FedrayError(f"unknown image layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    index = walked_index(root)
    positions = pc.index_in(image_ids, value_set=index.column("image_id"))
    relative = index.column("path").combine_chunks().take(positions)
    return pc.binary_join_element_wise(pa.scalar(str(root)), relative, "/")
