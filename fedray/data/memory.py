"""Federations held in memory (a federation's images embedded by a model being trained), and the name a run records."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np

from fedray.core.lazy_modules import lazy_module
from fedray.core.federation import TEST, TRAIN, Federation

torch = lazy_module("torch", globals())

MEMORY = "memory"
"""The kind of :func:`memory_label`'s names (a dataset spec of that kind is refused: nothing to load it from)."""
DIGEST_ROWS = 16_384
"""Rows whose features are hashed at a time."""


@dataclass
class ArrayFeatures:
    """``rows[split][i]`` is the feature vector of sample id ``ids[split][i]``."""

    dim: int
    ids: dict[str, np.ndarray]
    rows: dict[str, torch.Tensor]

    def features(self, split: str, sample_ids: np.ndarray) -> torch.Tensor:
        order = np.argsort(self.ids[split])
        position = order[np.searchsorted(self.ids[split], sample_ids, sorter=order)]
        return self.rows[split][torch.from_numpy(position)]


def with_features(federation: Federation, train: torch.Tensor, test: torch.Tensor) -> Federation:
    """``federation`` whose features are ``train`` (its train samples in client order) and ``test`` (its test samples)."""
    train_ids = federation.train_arrays(0, federation.num_clients)[0]
    test_ids = federation.test_arrays()[0]
    source = ArrayFeatures(train.shape[1], {TRAIN: train_ids, TEST: test_ids}, {TRAIN: train, TEST: test})
    return replace(federation, source=source, spec=None)


def memory_label(federation: Federation) -> str:
    """``memory:NAME@HASH``: what a run on a federation without a spec records as its dataset (a name, not a spec).

    The hash (12 hex digits of a SHA-256) covers C, the clients' rows in order and every feature, so runs on the
    same data carry the same label and a checkpoint resumes only on it.
    """
    source = federation.require_features()
    digest = hashlib.sha256(f"C={federation.num_classes}".encode())
    for split, rows in ((TRAIN, federation.train), (TEST, federation.test)):
        digest.update(f";{split}={rows.num_rows}".encode())
        if split == TRAIN:
            digest.update(rows.column("client_index").to_numpy().tobytes())
        digest.update(rows.column("label").to_numpy().astype(np.int32).tobytes())
        sample_ids = rows.column("sample_id").to_numpy()
        for start in range(0, len(sample_ids), DIGEST_ROWS):
            features = source.features(split, sample_ids[start:start + DIGEST_ROWS])
            digest.update(features.to(torch.float32).contiguous().numpy().tobytes())
    return f"{MEMORY}:{federation.name}@{digest.hexdigest()[:12]}"
