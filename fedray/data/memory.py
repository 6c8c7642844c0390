"""Features held in memory, indexed by sample id: a federation's images embedded by a model being trained."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from fedray.data.federation import TEST, TRAIN, Federation


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
