"""``ImageFolder``-style datasets: ``ROOT/train/<class>/*`` and ``ROOT/test/<class>/*``.

Classes are the sub-folder names of both splits, numbered in sorted order. An
image folder has no clients of its own: alone it is one client, ``all``,
holding every training image (the centralized reference); the Dirichlet(α) and
classes-per-client splitters (``?split=…``) make the federation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from fedray.core.federation import TEST, TRAIN, Federation, split_table
from fedray.core.errors import FedrayError
from fedray.data.images.index import image_files

ONE_CLIENT = "all"


def _class_folders(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir() if entry.is_dir())


def load_image_folder(root: str | Path) -> Federation:
    root = Path(root).resolve()
    train_dir, test_dir = root / TRAIN, root / TEST
    if not train_dir.is_dir():
        raise FedrayError(f"{root}: no {TRAIN}/ folder (expected {TRAIN}/<class>/<image> and {TEST}/<class>/<image>)")
    classes = sorted(set(_class_folders(train_dir)) | set(_class_folders(test_dir) if test_dir.is_dir() else ()))
    if not classes:
        raise FedrayError(f"{train_dir}: no class folders")
    label_of = {name: label for label, name in enumerate(classes)}
    paths, labels, splits = [], [], []
    for split, folder in ((TRAIN, train_dir), (TEST, test_dir)):
        if not folder.is_dir():
            continue
        for name in _class_folders(folder):
            files = image_files(folder / name)
            paths += [str(f) for f in files]
            labels += [label_of[name]] * len(files)
            splits += [split] * len(files)
    splits = np.array(splits)
    if not (splits == TRAIN).any():
        raise FedrayError(f"{train_dir}: no images")
    table = split_table(
        client_id=np.where(splits == TRAIN, ONE_CLIENT, None),
        sample_id=np.arange(len(paths)),
        label=np.array(labels),
        split=splits,
        image_path=pa.array(paths, pa.string()),
        class_name=pa.array([classes[label] for label in labels], pa.string()),
    )
    return Federation(f"imagefolder:{root}", len(classes), table, source=None)
