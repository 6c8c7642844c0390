"""FedCOF's ablations (FedCOF §4.3, App. F, App. L) against their formulas written out in numpy, alone and through
shards."""

import numpy as np
import pytest
import torch

import fedray
from fedray.core.errors import FedrayError
from fedray.methods import FedCOF, FedCOFOracle
from fedray.methods.base import ClientBatch
from tests.conftest import all_clients_batch

SPEC = "synthetic:inat-user-120k?dim=24&scale=0.04&classes=60"


def numpy_data(federation) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    return federation.source.features("train", sample_ids).double().numpy(), labels.astype(np.int64), offsets


def unit_columns(w: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(w, axis=0)
    return w / np.where(norms > 0, norms, 1)


def class_sums(z: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """B = ZᵀY: each class's feature sum in its column (d × C)."""
    return np.stack([z[labels == c].sum(0) for c in range(num_classes)], 1)


def between_class_scatter(z: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """G_btw = Σ_c N_c (μ_c − μ_g)(μ_c − μ_g)ᵀ (FedCOF Eq. 7)."""
    mu_g, scatter = z.mean(0), np.zeros((z.shape[1], z.shape[1]))
    for c in range(num_classes):
        if (labels == c).any():
            gap = z[labels == c].mean(0) - mu_g
            scatter += (labels == c).sum() * np.outer(gap, gap)
    return scatter


def shared_covariance_classifier(z: np.ndarray, labels: np.ndarray, num_classes: int, gamma: float, covariance: str,
                                 between_class: bool) -> np.ndarray:
    """G = Σ_c (N_c−1) D_c + N μ_g μ_gᵀ (+ G_btw) + γ Σ_c (N_c−1) I, D_c the diagonal of the class's sample
    covariance, or its trace/d times I; W = G⁻¹ B, unit columns."""
    d = z.shape[1]
    g = len(z) * np.outer(z.mean(0), z.mean(0))
    for c in range(num_classes):
        zc = z[labels == c]
        if len(zc) < 2:
            continue
        sigma = np.cov(zc, rowvar=False)
        shared = np.diag(np.diag(sigma)) if covariance == "diagonal" else np.trace(sigma) / d * np.eye(d)
        g += (len(zc) - 1) * (shared + gamma * np.eye(d))
    if between_class:
        g += between_class_scatter(z, labels, num_classes)
    return unit_columns(np.linalg.solve(g, class_sums(z, labels, num_classes)))


def fedcof_with_between_class(z: np.ndarray, labels: np.ndarray, offsets: np.ndarray, num_classes: int,
                              gamma: float) -> np.ndarray:
    """FedCOF's Ĝ (Eq. 6 and 8) from each client's class means, plus G_btw (Eq. 7), W = Ĝ⁻¹ B, unit columns."""
    d = z.shape[1]
    g = len(z) * np.outer(z.mean(0), z.mean(0)) + between_class_scatter(z, labels, num_classes)
    for c in range(num_classes):
        received = [(int((labels[a:b] == c).sum()), z[a:b][labels[a:b] == c].mean(0))
                    for a, b in zip(offsets[:-1], offsets[1:]) if (labels[a:b] == c).any()]
        if not received:
            continue
        n_c = sum(n for n, _ in received)
        mu_c = sum(n * mean for n, mean in received) / n_c
        spread = sum(n * np.outer(mean - mu_c, mean - mu_c) for n, mean in received)
        sigma = (spread / (len(received) - 1) if len(received) > 1 else 0) + gamma * np.eye(d)
        g += (n_c - 1) * sigma
    return unit_columns(np.linalg.solve(g, class_sums(z, labels, num_classes)))


def client_by_client(method, batch: ClientBatch):
    """Each client's statistics, combined: what the clients' uploads add up to."""
    total = None
    for k in range(len(batch.clients)):
        start, stop = batch.offsets[k], batch.offsets[k + 1]
        one = ClientBatch(batch.features[start:stop], batch.labels[start:stop], np.array([0, stop - start]),
                          batch.clients[k : k + 1])
        total = method.client_statistics(one) if total is None else method.combine(total, method.client_statistics(one))
    return total


def relative(a: torch.Tensor | np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


def test_the_oracle_with_between_class_scatter_and_no_shrinkage_is_unregularized_ridge(small_inat):
    z, labels, _ = numpy_data(small_inat)
    y = np.eye(small_inat.num_classes)[labels]
    ridge = unit_columns(np.linalg.solve(z.T @ z, z.T @ y))
    method = FedCOFOracle(small_inat.dim, small_inat.num_classes, gamma=0.0, between_class=True)
    weight = method.solve(client_by_client(method, all_clients_batch(small_inat))).weight
    assert relative(weight, ridge) <= 1e-10
    without = FedCOFOracle(small_inat.dim, small_inat.num_classes, gamma=0.0)
    assert relative(without.solve(without.client_statistics(all_clients_batch(small_inat))).weight, ridge) > 1e-3


@pytest.mark.parametrize("covariance", ["diagonal", "spherical"])
@pytest.mark.parametrize("between_class", [False, True])
def test_shared_diagonal_or_spherical_covariances_follow_their_formulas(small_inat, covariance, between_class):
    z, labels, _ = numpy_data(small_inat)
    expected = shared_covariance_classifier(z, labels, small_inat.num_classes, 0.1, covariance, between_class)
    method = FedCOFOracle(small_inat.dim, small_inat.num_classes, gamma=0.1, covariance=covariance,
                          between_class=between_class)
    batch = all_clients_batch(small_inat)
    assert relative(method.solve(client_by_client(method, batch)).weight, expected) <= 1e-10
    assert relative(method.solve(method.client_statistics(batch)).weight, expected) <= 1e-10


def test_fedcof_with_between_class_scatter_adds_it_to_its_estimate(small_inat):
    z, labels, offsets = numpy_data(small_inat)
    expected = fedcof_with_between_class(z, labels, offsets, small_inat.num_classes, 0.1)
    method = FedCOF(small_inat.dim, small_inat.num_classes, gamma=0.1, between_class=True)
    stats = method.client_statistics(all_clients_batch(small_inat))
    assert relative(method.solve(stats).weight, expected) <= 1e-9
    kept, blocks = method.kept_in_shards(stats)  # the second pass, in one process
    second = method.second_pass(method.second_pass_request(kept), blocks)
    assert relative(method.solve_second(kept, second).weight, expected) <= 1e-9


def test_the_defaults_are_todays_classifiers_to_the_bit(small_inat):
    batch = all_clients_batch(small_inat)
    d, classes = small_inat.dim, small_inat.num_classes
    for plain, default in ((FedCOF(d, classes), FedCOF(d, classes, between_class=False)),
                           (FedCOFOracle(d, classes), FedCOFOracle(d, classes, covariance="full", between_class=False))):
        assert torch.equal(plain.solve(plain.client_statistics(batch)).weight,
                           default.solve(default.client_statistics(batch)).weight)
        assert np.array_equal(plain.upload_floats(small_inat), default.upload_floats(small_inat))


def test_the_upload_follows_what_is_shared(small_inat):
    _, labels, offsets = numpy_data(small_inat)
    held = np.array([len(np.unique(labels[a:b])) for a, b in zip(offsets[:-1], offsets[1:])])
    d = small_inat.dim
    for covariance, floats in (("full", d + d * d), ("diagonal", 2 * d), ("spherical", d + 1)):
        method = FedCOFOracle(d, small_inat.num_classes, covariance=covariance)
        assert np.array_equal(method.upload_floats(small_inat), held * floats)
        assert np.array_equal(method.paper_costs(small_inat).fedcof_floats, held * floats)


@pytest.mark.parametrize("means_per_class", [1, 3])
def test_the_labels_alone_give_the_counts_and_the_number_of_means_of_each_class(small_inat, means_per_class):
    """What every evaluation's weights w_c = (N_c−1)/(K_c−1) need, known before any feature is read."""
    method = FedCOF(small_inat.dim, small_inat.num_classes, means_per_class=means_per_class)
    batch = all_clients_batch(small_inat)
    counted = method.label_statistics(ClientBatch(batch.features[:, :0], batch.labels, batch.offsets, batch.clients))
    received = method.client_statistics(batch)
    labels = batch.labels.numpy()
    assert torch.equal(counted.counts, torch.from_numpy(np.bincount(labels, minlength=60).astype(np.float64)))
    assert torch.equal(counted.received, received.received) and counted.blocks == []
    assert counted.received.sum() == method.rows_per_client(small_inat).sum()
    assert tuple(counted.sums.shape) == (60, 0)
    assert FedCOFOracle(small_inat.dim, small_inat.num_classes).label_statistics(batch) is None


@pytest.mark.parametrize("method, options", [
    ("fedcof-oracle", {"covariance": "diagonal"}),
    ("fedcof-oracle", {"covariance": "spherical"}),
    ("fedcof-oracle", {"between_class": True}),
    ("fedcof", {"between_class": True}),  # its second pass: the means stay in the shards
], ids=["diagonal", "spherical", "oracle-between", "fedcof-between"])
def test_a_run_through_shards_is_the_solve_in_one_process(ray_session, tmp_path, method, options):
    result = fedray.run(method=method, options=options, dataset=SPEC, num_shards=2, cpus_per_shard=0.5, quiet=True,
                        out=tmp_path / "run")
    federation = fedray.load_federation(SPEC)
    alone = fedray.methods.METHODS[method](federation.dim, federation.num_classes, **options)
    expected = alone.solve(alone.client_statistics(all_clients_batch(federation))).weight.numpy()
    assert relative(result.classifier.weight, expected) <= 1e-10
    written = {column: result.metrics[column][-1] for column in options}
    assert written == options
    floats = alone.upload_floats(federation).sum()
    assert result.metrics["bytes_up"][-1] == 4 * floats


@pytest.mark.parametrize("options, message", [
    ({"covariance": "foo"}, "--covariance must be full, diagonal or spherical, got 'foo'"),
    ({"between_class": "maybe"}, "fedray.run: option between_class must be true or false, got 'maybe'"),
])
def test_bad_values_are_refused_in_one_line_before_any_work(ray_session, tmp_path, options, message):
    with pytest.raises(FedrayError) as refused:
        fedray.run(method="fedcof-oracle", options=options, dataset=SPEC, quiet=True, out=tmp_path / "run")
    assert str(refused.value) == message
    assert not (tmp_path / "run").exists()
