"""A shard's statistics through secure aggregation with modelled masks, computed at each client's classes only, are
the dense per-client path's and the generated masks' bit for bit, and the plain quantized sum of the survivors."""

import numpy as np
import pytest
import torch

import fedray
from fedray.core.reports import reporting
from fedray.methods.ncm import FedNCM
from fedray.methods.postprocessor import Postprocessing, flatten
from fedray.methods.ridge import Fed3R, Fed3RRandomFeatures
from fedray.postprocessors.secagg import SecureAggregation
from fedray.runtime import compact_sum as compact_module
from fedray.runtime import shard_statistics
from fedray.runtime.kept import KeptParts
from fedray.runtime.shard_rows import HeldRows, Rows
from fedray.runtime.shard_statistics import ShardStatistics

SEED, ROUND, DIM, CLASSES, CLIP, VALUE_BITS = 5, 3, 12, 10, 40.0, 20
FIRST_CLIENT = 100
"""The shard's first client: its clients are 100 .. 139, numbered globally."""


def shard() -> tuple[HeldRows, list[np.ndarray], list[np.ndarray]]:
    """40 clients of 1 to 20 samples, each of 2 to 4 of the 10 classes: the rows, each client's features and labels."""
    rng = np.random.default_rng(0)
    features, labels = [], []
    for _ in range(40):
        size = int(rng.integers(1, 21))
        held = rng.choice(CLASSES, size=int(rng.integers(2, 5)), replace=False)
        features.append(rng.normal(scale=1.5, size=(size, DIM)).astype(np.float32))
        labels.append(rng.choice(held, size=size))
    offsets = np.concatenate([[0], np.cumsum([len(rows) for rows in labels])])
    rows = Rows(torch.from_numpy(np.concatenate(features)), np.concatenate(labels), offsets,
                torch.zeros(0, DIM), np.zeros(0, dtype=np.int64))
    return HeldRows(rows, FIRST_CLIENT), features, labels


class DenseModelled(SecureAggregation):
    """secagg's modelled masks through its client hook, each client's upload whole: the path before compact sums."""

    entrywise = False


def through(secagg: type[SecureAggregation], method, clients: np.ndarray, **options) -> tuple:
    """The shard's statistics of ``clients`` (uploading in round 0) through ``secagg``, the server's aggregate of them
    and the clients that dropped."""
    rows, _, _ = shard()
    postprocessing = Postprocessing((secagg(secagg_clip=CLIP, secagg_value_bits=VALUE_BITS, secagg_dropout=0.25,
                                            secagg_neighbours=6, secagg_threshold=2, **options),), SEED)
    postprocessing = postprocessing.among(clients, ROUND)
    total = ShardStatistics(rows, KeptParts()).statistics(method, clients, postprocessing,
                                                          np.zeros(len(clients), int)).root(1, method.combine)
    with reporting({}):
        aggregate = postprocessing.aggregate(total, ROUND, len(clients), method.upload_parts())
    return total, aggregate, set(postprocessing.dropped(ROUND).tolist())


def plain_statistics(features: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """One client's Fed3R and FedNCM statistics written out: ZᵀZ, ZᵀY and the class sums and counts added row by row."""
    z = features.astype(np.float64)
    targets, sums, counts = np.zeros((DIM, CLASSES)), np.zeros((CLASSES, DIM)), np.zeros(CLASSES)
    for row, label in zip(z, labels):
        targets[:, label] += row
        sums[label] += row
        counts[label] += 1
    return {"gram": z.T @ z, "targets": targets, "sums": sums, "counts": counts}


def survivors_quantized_sum(clients: np.ndarray, dropped: set[int]) -> dict[str, np.ndarray]:
    """Σ over the surviving clients of rint(clip(x) / Δ), as Python integers, times Δ = C / (2^(v−1) − 1)."""
    _, features, labels = shard()
    step = CLIP / (2**(VALUE_BITS - 1) - 1)
    total: dict[str, np.ndarray] = {}
    for client in clients.tolist():
        if client in dropped:
            continue
        for name, values in plain_statistics(features[client - FIRST_CLIENT], labels[client - FIRST_CLIENT]).items():
            q = np.rint(np.clip(values, -CLIP, CLIP) / step).astype(np.int64).astype(object)
            total[name] = total.get(name, 0) + q
    return {name: value.astype(np.int64).astype(np.float64) * step for name, value in total.items()}


CLIENTS = np.array([131, 102, 139, 117, 100, 125, 108, 133, 111, 120, 104, 136, 115, 129, 106, 122, 113, 138, 101,
                    127, 110, 134, 119, 103])
"""24 of the shard's 40 clients, in upload order (not sorted)."""


@pytest.mark.parametrize("method", [Fed3R(DIM, CLASSES), FedNCM(DIM, CLASSES)], ids=["fed3r", "fedncm"])
def test_compact_modelled_sums_are_the_dense_ones_the_generated_masks_and_the_plain_quantized_sum(method, monkeypatch):
    compact_calls = []
    monkeypatch.setattr(shard_statistics, "compact_sum",
                        lambda *args: compact_calls.append(args) or compact_module.compact_sum(*args))
    compact, compact_aggregate, dropped = through(SecureAggregation, method, CLIENTS)
    assert len(compact_calls) == 1
    dense, dense_aggregate, _ = through(DenseModelled, method, CLIENTS)
    _, generated_aggregate, _ = through(SecureAggregation, method, CLIENTS, secagg_masks="generate")
    assert len(compact_calls) == 1 and 0 < len(dropped) < len(CLIENTS) // 2
    for name, values in flatten(compact).items():
        assert torch.equal(values, flatten(dense)[name]), name
        assert torch.equal(values, values.round()), name  # the survivors' integers, centred
    expected = survivors_quantized_sum(CLIENTS, dropped)
    for name, values in flatten(compact_aggregate).items():
        assert torch.equal(values, flatten(dense_aggregate)[name]), name
        assert torch.equal(values, flatten(generated_aggregate)[name]), name
        assert np.array_equal(values.numpy(), expected[name]), name
    assert flatten(compact_aggregate).keys() <= expected.keys()


class Thirds(fedray.Postprocessor):
    """Each value divided by 3, on its own (0 to 0): its sums round, so the order of the additions shows in the bits."""

    @property
    def entrywise(self) -> bool:
        return True

    def client(self, upload: fedray.Upload, context: fedray.UploadContext) -> fedray.Upload:
        return fedray.Upload({name: tensor / 3 for name, tensor in upload.tensors.items()}, upload.weight)

    def entry_map(self, context: fedray.UploadContext):
        return lambda values: values / 3


class DenseThirds(Thirds):
    entrywise = False


@pytest.mark.parametrize("method", [Fed3R(DIM, CLASSES), Fed3R(DIM, CLASSES, bias=True),
                                    Fed3RRandomFeatures(DIM, CLASSES, rf_dim=20), FedNCM(DIM, CLASSES)],
                         ids=["fed3r", "fed3r-bias", "fed3r-rf", "fedncm"])
def test_compact_sums_in_chunks_add_each_entry_in_upload_order_as_the_dense_sum(method, monkeypatch):
    monkeypatch.setattr(compact_module, "CHUNK_VALUES", 500)  # a few clients a chunk
    sums = {}
    for postprocessor in (Thirds(), DenseThirds()):
        rows, _, _ = shard()
        postprocessing = Postprocessing((postprocessor,), SEED).among(CLIENTS, ROUND)
        sums[type(postprocessor)] = flatten(ShardStatistics(rows, KeptParts()).statistics(
            method, CLIENTS, postprocessing, np.zeros(len(CLIENTS), int)))
    assert Postprocessing((Thirds(),)).entrywise and not Postprocessing((DenseThirds(),)).entrywise
    for name, values in sums[Thirds].items():
        assert torch.equal(values, sums[DenseThirds][name]), name
