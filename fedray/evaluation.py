"""Accuracy of a classifier on the federation's test set (held by the server)."""

from __future__ import annotations

import torch

from fedray.data.federation import TEST, Federation
from fedray.methods.base import Classifier, ClosedFormMethod

CHUNK = 8192


class Evaluator:
    def __init__(self, federation: Federation) -> None:
        sample_ids, labels = federation.test_arrays()
        self.features = federation.require_features().features(TEST, sample_ids)
        self.labels = torch.from_numpy(labels.astype("int64"))
        self._transformed: tuple[ClosedFormMethod, torch.Tensor] | None = None

    def _inputs(self, method: ClosedFormMethod) -> torch.Tensor:
        """Test features through the method's feature map, computed once per method."""
        if self._transformed is None or self._transformed[0] is not method:
            self._transformed = (method, method.transform(self.features).to(torch.float32))
        return self._transformed[1]

    def accuracy(self, method: ClosedFormMethod, classifier: Classifier) -> float:
        if len(self.labels) == 0:
            return float("nan")
        inputs = self._inputs(method)
        weight = classifier.weight.to(torch.float32)
        bias = None if classifier.bias is None else classifier.bias.to(torch.float32)
        correct = 0
        for start in range(0, len(inputs), CHUNK):
            scores = inputs[start : start + CHUNK] @ weight
            if bias is not None:
                scores += bias
            correct += int((scores.argmax(1) == self.labels[start : start + CHUNK]).sum())
        return correct / len(self.labels)
