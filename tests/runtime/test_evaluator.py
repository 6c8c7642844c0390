"""The accuracy counted in the shards is the plain one, bit for bit the same on any number of shards."""

import pytest
import torch

from fedray.data import synthetic
from fedray.methods.evaluation import CHUNK
from fedray.methods.base import Classifier
from fedray.runtime.evaluator import Evaluator
from fedray.runtime.shards import ShardPool


class Identity:
    def transform(self, features):
        return features


@pytest.mark.slow
def test_the_shards_count_every_test_row_once(ray_session):
    federation = synthetic.build("inat-user-120k", dim=8, scale=0.5, classes=30, seed=5)
    test_ids, labels = federation.test_arrays()
    assert len(test_ids) > 2 * CHUNK, "several chunks, spread over the shards"
    generator = torch.Generator().manual_seed(1)
    classifier = Classifier(torch.randn(8, 30, generator=generator, dtype=torch.float64), torch.randn(30, generator=generator))
    features = federation.require_features().features("test", test_ids)
    scores = features @ classifier.weight.float() + classifier.bias
    expected = int((scores.argmax(1).numpy() == labels).sum()) / len(labels)
    accuracies = []
    for shards in (1, 3):
        pool = ShardPool.start(federation, num_shards=shards, cpus_per_shard=2 / shards, reusable=True)
        try:
            accuracies.append(Evaluator(pool).accuracy(Identity(), classifier))
        finally:
            pool.shutdown()
    assert accuracies == [expected, expected]
