"""The checks of what the engine receives, on the built-ins: they pass what fedray's own methods and algorithms return
(a run of each plugin kind that fails them is in tests/app/test_plugin_outputs.py)."""

import re

import numpy as np
import pytest
import torch

from fedray.core.errors import FedrayError
from fedray.methods.base import ClientBatch, Classifier
from fedray.methods.algorithm import Upload
from fedray.methods.checks import (check_classifier, check_like, check_state, check_upload_like, combine_checked,
                                   statistics_finite)
from fedray.methods.fedcof import FedCOF
from fedray.methods.ncm import ClassSums, FedNCM
from fedray.methods.postprocessor import Postprocessing, Postprocessor


def batch(clients: list[int], sizes: list[int], dim: int = 3, classes: int = 4) -> ClientBatch:
    rows = sum(sizes)
    generator = torch.Generator().manual_seed(0)
    return ClientBatch(torch.randn(rows, dim, generator=generator), torch.arange(rows) % classes,
                       np.concatenate([[0], np.cumsum(sizes)]), np.array(clients))


def test_fedcofs_received_means_grow_in_a_list_and_pass():
    method = FedCOF(3, 4)
    a, b = method.client_statistics(batch([0], [5])), method.client_statistics(batch([1, 2], [3, 6]))
    total = combine_checked(method, a, b)
    assert len(total.blocks) == 2 and torch.equal(total.counts, a.counts + b.counts)


def test_statistics_of_another_shape_are_refused_before_combine():
    method = FedNCM(3, 4)
    a = method.client_statistics(batch([0], [5]))
    with pytest.raises(FedrayError) as error:
        combine_checked(method, a, ClassSums(a.counts[:2], a.sums))
    assert str(error.value) == "fedray's fedncm: client_statistics returned statistics of changing shape (the tensor at " \
        "'counts' is (4,) in one and (2,) in another); expected the same shapes from every client and round (they are " \
        "added; what grows with the clients goes in a list, as FedCOF's received means)"


def test_a_classifier_check_names_non_finite_statistics():
    method = FedNCM(3, 4)
    weight = torch.zeros(3, 4)
    assert check_classifier(method, Classifier(weight), 3, 4, 1, lambda: True).weight is weight
    weight[0, 0] = float("inf")
    with pytest.raises(FedrayError) as error:
        check_classifier(method, Classifier(weight), 3, 4, 7, lambda: statistics_finite((torch.tensor([float("nan")]),)))
    assert str(error.value) == "fedray's fedncm: solve returned a classifier with NaN or inf in its weight after round 7 " \
        "(its statistics already hold NaN or inf: from client_statistics or combine); expected finite values"


def test_names_and_shapes_and_states():
    like = {"weight": torch.zeros(3, 4), "bias": torch.zeros(4)}
    owner = FedNCM(3, 4)
    assert check_like(owner, "step", {"bias": torch.ones(4), "weight": torch.ones(3, 4)}, like, "Δ") is not None
    with pytest.raises(FedrayError, match=r"step returned tensors without bias; with extra too; expected Δ: a dict of "
                                          r"tensors named bias, weight with their shapes$"):
        check_like(owner, "step", {"weight": torch.ones(3, 4), "extra": torch.ones(1)}, like, "Δ")
    check_state(owner, "step", {"weight": {"m": torch.zeros(3, 4)}}, "tensors in dicts by name")
    with pytest.raises(FedrayError, match=r"its state holds a ndarray at weight.m after step"):
        check_state(owner, "step", {"weight": {"m": np.zeros(3)}}, "tensors in dicts by name")


class Halving(Postprocessor):
    def __init__(self, returned=None) -> None:
        super().__init__()
        self.returned = returned

    def features(self, features: torch.Tensor) -> torch.Tensor:
        return features / 2 if self.returned is None else self.returned


class KeepEven(Postprocessor):
    """Keeps a client's even rows (or returns ``returned``)."""

    def __init__(self, returned=None) -> None:
        super().__init__()
        self.returned = returned

    def select(self, labels: torch.Tensor, context) -> torch.Tensor | None:
        return torch.arange(0, len(labels), 2) if self.returned is None else self.returned


@pytest.mark.parametrize("returned, got", [
    ([0, 2], "a list (round 3, client 1)"),
    (torch.tensor([0, 2], dtype=torch.int32), "a Tensor of shape (2,) (round 3, client 1)"),
    (torch.tensor([2, 0]), r"indices [2, 0] (round 3, client 1)"),
    (torch.tensor([0, 4]), r"indices [0, 4] (round 3, client 1)"),
    (torch.tensor([], dtype=torch.int64), r"indices [] (round 3, client 1)"),
])
def test_a_select_hook_keeps_rows_of_each_client_or_stops_in_one_line(returned, got):
    """Two clients of 4 and 3 rows: the even rows of each are kept (rows 0, 2 | 4, 6), offsets follow; a wrong
    selection names the plugin, the hook, the round and the client."""
    batch = ClientBatch(torch.arange(7, dtype=torch.float64).unsqueeze(1), torch.arange(7), np.array([0, 4, 7]),
                        np.array([0, 1]))
    kept = Postprocessing((KeepEven(),)).selected(batch, [3, 3])
    assert kept.labels.tolist() == [0, 2, 4, 6] and kept.offsets.tolist() == [0, 2, 4]
    assert kept.features.flatten().tolist() == [0.0, 2.0, 4.0, 6.0]
    everything = Postprocessing((KeepEven(torch.tensor([0, 1, 2, 3])),)).selected(
        ClientBatch(batch.features[:4], batch.labels[:4], np.array([0, 4]), np.array([0])), [3])
    assert everything.features.data_ptr() == batch.features.data_ptr()  # all rows kept: the batch itself
    with pytest.raises(FedrayError, match=rf"^the plugin tests.methods.test_checks:KeepEven: select returned "
                                          rf"{re.escape(got)}; expected None or increasing int64 indices"):
        Postprocessing((KeepEven(returned),)).selected(
            ClientBatch(batch.features[4:], batch.labels[4:], np.array([0, 3]), np.array([1])), [3])


@pytest.mark.parametrize("returned, got", [
    ("rows", "a str"),
    (torch.zeros(4, 3, dtype=torch.float32), "torch.float32 rows of shape (4, 3)"),
    (torch.zeros(2, 3, dtype=torch.float64), "torch.float64 rows of shape (2, 3)"),
    (torch.full((4, 3), float("nan"), dtype=torch.float64), "rows with NaN or inf"),
])
def test_a_features_hook_must_return_finite_rows_of_the_rows_shape_and_dtype(returned, got):
    rows = torch.ones(4, 3, dtype=torch.float64)
    assert torch.equal(Postprocessing((Halving(),)).features(rows), torch.full((4, 3), 0.5, dtype=torch.float64))
    with pytest.raises(FedrayError, match=rf"^the plugin tests.methods.test_checks:Halving: features returned {re.escape(got)}; expected finite "
                                          rf"torch.float64 rows of shape \(4, 3\)$"):
        Postprocessing((Halving(returned),)).features(rows)


@pytest.mark.parametrize("values, refused", [
    ([1e308, 1e308, -1.0], False),  # finite, though their sum overflows
    ([1.0, float("nan"), 2.0], True),
    ([float("inf"), float("-inf"), 0.0], True),
    ([float("inf"), 1.0, 0.0], True),
])
def test_an_upload_with_nan_or_inf_is_refused_and_finite_values_are_not(values, refused):
    got = Upload({"w": torch.zeros(3, dtype=torch.float64)}, 1.0)
    returned = Upload({"w": torch.tensor(values, dtype=torch.float64)}, 1.0)
    if not refused:
        assert check_upload_like(object(), got, returned, False, "round 1, client 0") is returned
        return
    with pytest.raises(FedrayError, match=r"client returned w with NaN or inf \(round 1, client 0; it got finite "
                                          r"values\); expected finite values$"):
        check_upload_like(object(), got, returned, False, "round 1, client 0")
