"""Counting correct predictions on the test rows, chunk by chunk: the chunks shards hold and the counts they return."""

import pytest
import torch

from fedray.methods.evaluation import CHUNK, EvalRows, eval_bounds, predictions
from fedray.methods.base import Classifier


@pytest.mark.parametrize("rows, shards, expected", [
    (35_641, 1, [0, 35_641]),
    (35_641, 2, [0, 2 * CHUNK, 35_641]),  # 5 chunks: 2 and 3
    (35_641, 3, [0, CHUNK, 3 * CHUNK, 35_641]),  # 1, 2 and 2
    (2 * CHUNK, 2, [0, CHUNK, 2 * CHUNK]),
    (100, 3, [0, 0, 0, 100]),  # one chunk: the last shard holds it
    (0, 2, [0, 0, 0]),
])
def test_shards_hold_whole_chunks_balanced_by_count(rows, shards, expected):
    assert eval_bounds(rows, shards).tolist() == expected


class Doubling:
    """A feature map that counts how often a shard fetches it."""

    fetched = 0

    def transform(self, features):
        return 2 * features


def test_the_count_is_the_plain_argmax_count_and_the_map_is_fetched_once_per_key():
    generator = torch.Generator().manual_seed(0)
    rows = 2 * CHUNK + 1000  # three chunks, the last one partial
    features = torch.randn(rows, 6, generator=generator)
    labels = torch.randint(0, 5, (rows,), generator=generator)
    weight, bias = torch.randn(6, 5, generator=generator, dtype=torch.float64), torch.randn(5, generator=generator)
    held = EvalRows(features, labels)
    fetches = []

    def fetch():
        fetches.append(1)
        return Doubling()

    expected = int(((2 * features) @ weight.float() + bias).argmax(1).eq(labels).sum())
    assert held.correct("a", fetch, Classifier(weight, bias)) == expected
    assert held.correct("a", fetch, Classifier(weight, bias)) == expected
    assert len(fetches) == 1, "the transformed rows are kept while the key stays"
    no_bias = int(((2 * features) @ weight.float()).argmax(1).eq(labels).sum())
    assert held.correct("b", fetch, Classifier(weight)) == no_bias
    assert len(fetches) == 2
    assert EvalRows(features[:0], labels[:0]).correct("a", fetch, Classifier(weight, bias)) == 0


def test_predictions_are_each_rows_first_maximum():
    scores = torch.tensor([[0.0, 2.0, 2.0], [5.0, -1.0, 5.0], [-3.0, -2.0, -4.0], [1.0, 1.0, 1.0]])
    assert predictions(scores).tolist() == [1, 0, 1, 0]


def test_a_classifier_with_other_classes_after_another_is_counted_on_its_own_scores():
    """The kept chunk of scores is C columns wide: a classifier with fewer, then more classes gets scores of its own."""
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(CHUNK + 10, 4, generator=generator)
    labels = torch.randint(0, 3, (CHUNK + 10,), generator=generator)
    held = EvalRows(features, labels)
    for classes in (7, 3, 9):
        weight = torch.randn(4, classes, generator=generator)
        expected = int((features @ weight).argmax(1).eq(labels).sum())
        assert held.correct("identity", lambda: Identity(), Classifier(weight)) == expected


class Identity:
    def transform(self, features):
        return features
