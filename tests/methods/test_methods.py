"""The closed-form methods against direct implementations of the papers' formulas (no Ray)."""

import math

import numpy as np
import pytest
import torch

from fedray.core.errors import FedrayError
from fedray.methods import METHODS, FedCOF, FedCOFOracle, Fed3R, Fed3RRandomFeatures, FedNCM, FastFederatedCalibration
from fedray.methods.base import ClientBatch
from tests.conftest import all_clients_batch
from tests.reference import (
    class_means,
    fedcof_algorithm1,
    fedcof_oracle,
    features_and_labels,
    max_relative_difference,
    normalized,
    ridge,
    ridge_with_bias,
)


def per_client_total(method, batch):
    """Statistics computed client by client and combined: what a real federation would do."""
    total = None
    for k in range(len(batch.clients)):
        start, stop = batch.offsets[k], batch.offsets[k + 1]
        one = ClientBatch(batch.features[start:stop], batch.labels[start:stop], np.array([0, stop - start]), batch.clients[k : k + 1])
        stats = method.client_statistics(one)
        total = stats if total is None else method.combine(total, stats)
    return total


def test_fedncm_equals_centralized_class_means(small_inat):
    z, labels, _ = features_and_labels(small_inat)
    method = FedNCM(small_inat.dim, small_inat.num_classes)
    weight = method.solve(method.client_statistics(all_clients_batch(small_inat))).weight
    expected = normalized(class_means(z, labels, small_inat.num_classes).T)
    assert max_relative_difference(weight, expected) <= 1e-12


def test_fed3r_equals_centralized_ridge(small_inat):
    z, labels, _ = features_and_labels(small_inat)
    method = Fed3R(small_inat.dim, small_inat.num_classes, lam=0.01)
    classifier = method.solve(per_client_total(method, all_clients_batch(small_inat)))
    assert classifier.bias is None
    assert max_relative_difference(classifier.weight, ridge(z, labels, small_inat.num_classes, 0.01)) <= 1e-8


@pytest.mark.parametrize("method_class", [Fed3R, Fed3RRandomFeatures, FastFederatedCalibration])
def test_ridge_bias_follows_the_fed3r_code(small_inat, method_class):
    """λ regularizes the bias too; Fed3R (and Fed3R-RF) divide w_c and b_c by ‖w_c‖ alone, FFC normalizes nothing."""
    options = {"rf_dim": 300, "rf_sigma": 20.0, "seed": 4} if method_class is Fed3RRandomFeatures else {}
    method = method_class(small_inat.dim, small_inat.num_classes, lam=0.05, bias=True, **options)
    z, labels, _ = features_and_labels(small_inat)
    # all clients in one batch: the float32 feature map of a client-sized batch rounds differently (BLAS blocking)
    classifier = method.solve(method.client_statistics(all_clients_batch(small_inat)))
    design = method.transform(z.to(torch.float32)).to(torch.float64)  # the client's feature map, in float32 as a client runs it
    expected_w, expected_b = ridge_with_bias(design, labels, small_inat.num_classes, 0.05,
                                             normalize=method_class is not FastFederatedCalibration)
    assert max_relative_difference(classifier.weight, expected_w) <= 1e-8
    assert max_relative_difference(classifier.bias, expected_b) <= 1e-8
    if method_class is not FastFederatedCalibration:
        seen = torch.bincount(labels, minlength=small_inat.num_classes) > 0
        torch.testing.assert_close(classifier.weight.norm(dim=0)[seen], torch.ones(int(seen.sum()), dtype=torch.float64),
                                   rtol=0, atol=1e-12)


def test_concatenated_clients_give_the_combined_statistics(small_inat):
    """What a shard computes in one GEMM equals the sum of the clients' own statistics."""
    method = Fed3R(small_inat.dim, small_inat.num_classes)
    batch = all_clients_batch(small_inat)
    together, apart = method.client_statistics(batch), per_client_total(method, batch)
    assert max_relative_difference(together.gram, apart.gram) <= 1e-12
    assert max_relative_difference(together.targets, apart.targets) <= 1e-12


def test_ffc_is_unnormalized_ridge_on_unit_features(small_inat):
    z, labels, _ = features_and_labels(small_inat)
    method = FastFederatedCalibration(small_inat.dim, small_inat.num_classes, lam=0.1)
    weight = method.solve(method.client_statistics(all_clients_batch(small_inat))).weight
    unit = z / z.norm(dim=1, keepdim=True)
    expected = ridge(unit, labels, small_inat.num_classes, 0.1, normalize=False)
    assert max_relative_difference(weight, expected) <= 1e-6  # features normalized in float32 on the client


def test_ffc_with_lambda_zero_is_sphereFeds_exact_least_squares(small_inat):
    z, labels, _ = features_and_labels(small_inat)
    method = FastFederatedCalibration(small_inat.dim, small_inat.num_classes, lam=0.0)
    weight = method.solve(method.client_statistics(all_clients_batch(small_inat))).weight
    unit = (z / z.norm(dim=1, keepdim=True)).to(torch.float64)
    one_hot = torch.nn.functional.one_hot(torch.as_tensor(labels, dtype=torch.long), small_inat.num_classes).to(torch.float64)
    expected = torch.linalg.lstsq(unit, one_hot, driver="gelsd").solution  # argmin ‖ZW − Y‖², SphereFed Eq. 6
    assert max_relative_difference(weight, expected) <= 1e-5


def test_ffc_with_lambda_zero_refuses_a_singular_system():
    few = ClientBatch(torch.randn(3, 8), torch.tensor([0, 1, 0]), np.array([0, 3]), np.array([0]))
    method = FastFederatedCalibration(8, 2, lam=0.0)
    with pytest.raises(FedrayError, match=r"FFC with --lam 0 .* singular .* give --lam > 0"):
        method.solve(method.client_statistics(few))


def test_fedcof_matches_its_algorithm_1(small_inat):
    z, labels, offsets = features_and_labels(small_inat)
    method = FedCOF(small_inat.dim, small_inat.num_classes, gamma=0.1)
    weight = method.solve(per_client_total(method, all_clients_batch(small_inat))).weight
    expected = fedcof_algorithm1(z, labels, offsets, small_inat.num_classes, gamma=0.1)
    assert max_relative_difference(weight, expected) <= 1e-8


def test_fedcof_oracle_uses_the_true_class_covariances(small_inat):
    z, labels, _ = features_and_labels(small_inat)
    method = FedCOFOracle(small_inat.dim, small_inat.num_classes, gamma=0.1)
    weight = method.solve(per_client_total(method, all_clients_batch(small_inat))).weight
    assert max_relative_difference(weight, fedcof_oracle(z, labels, small_inat.num_classes, 0.1)) <= 1e-8


def test_fedcof_covariance_estimator_is_unbiased():
    """Monte Carlo: with Gaussian class features, the mean of Σ̂ over many federations is Σ."""
    rng = np.random.default_rng(0)
    d, trials = 3, 400  # the naive estimate is 3.2 times too large: 400 federations show it
    mixing = rng.normal(size=(d, d))
    true_cov = mixing @ mixing.T + 0.5 * np.eye(d)
    sizes = np.array([1, 1, 2, 3, 5, 8, 2, 1, 4, 6])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    method = FedCOF(d, num_classes=1, gamma=0.0)
    estimates = np.empty((trials, d, d))
    for t in range(trials):
        z = rng.multivariate_normal(np.ones(d), true_cov, size=sizes.sum())
        batch = ClientBatch(torch.from_numpy(z), torch.zeros(len(z), dtype=torch.long), offsets, np.arange(len(sizes)))
        stats = method.client_statistics(batch)
        estimates[t] = method.spread(stats).numpy() / (sizes.sum() - 1)
    mean, stderr = estimates.mean(0), estimates.std(0, ddof=1) / math.sqrt(trials)
    assert np.all(np.abs(mean - true_cov) <= 4 * stderr)
    naive = estimates * (sizes.sum() - 1) / len(sizes)  # dividing by K instead of K−1 is biased
    assert np.any(np.abs(naive.mean(0) - true_cov) > 4 * stderr)


def test_multiple_means_per_class_follow_appendix_e(small_inat):
    method = FedCOF(small_inat.dim, small_inat.num_classes, means_per_class=3)
    batch = all_clients_batch(small_inat)
    stats = method.client_statistics(batch)
    (block,) = stats.blocks
    assert int(block.counts.sum()) == len(batch.labels)
    assert block.counts.min() >= 1
    clients = small_inat.train.column("client_index").to_numpy().astype(np.int64)
    _, group_sizes = np.unique(clients * small_inat.num_classes + batch.labels.numpy(), return_counts=True)
    assert int((block.counts == 1).sum()) == int((group_sizes == 1).sum())  # a mean of one sample only when n = 1
    assert len(block.counts) == int(method.rows_per_client(small_inat).sum())
    one = FedCOF(small_inat.dim, small_inat.num_classes).client_statistics(batch).blocks[0]
    assert len(block.counts) > len(one.counts) == int(small_inat.client_num_classes.sum())
    assert torch.equal(torch.bincount(block.classes, weights=block.counts), torch.bincount(one.classes, weights=one.counts))


def test_multiple_means_are_seeded_per_client(small_inat):
    batch = all_clients_batch(small_inat)
    first = FedCOF(small_inat.dim, small_inat.num_classes, means_per_class=3, seed=1).client_statistics(batch).blocks[0]
    again = FedCOF(small_inat.dim, small_inat.num_classes, means_per_class=3, seed=1).client_statistics(batch).blocks[0]
    other = FedCOF(small_inat.dim, small_inat.num_classes, means_per_class=3, seed=2).client_statistics(batch).blocks[0]
    assert torch.equal(first.means, again.means)
    assert not torch.equal(first.means, other.means)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_unseen_classes_get_zero_columns(small_inat, name):
    batch = all_clients_batch(small_inat)
    keep = batch.labels < small_inat.num_classes - 5
    rows = torch.nonzero(keep).squeeze(1)
    partial = ClientBatch(batch.features[rows], batch.labels[rows], np.array([0, len(rows)]), np.array([0]))
    options = {"rf_dim": 64, "rf_sigma": 3.0} if name == "fed3r-rf" else {}
    method = METHODS[name](small_inat.dim, small_inat.num_classes, **options)
    classifier = method.solve(method.client_statistics(partial))
    weight = classifier.weight
    assert torch.isfinite(weight).all()
    if name == "ccvr":  # a softmax fit over every class (as CCVR's linear layer): the unseen ones' scores are trained
        scores = partial.features.to(weight.dtype) @ weight + classifier.bias  # down, to never win, not zeroed
        assert (scores.argmax(1) < small_inat.num_classes - 5).all() and (weight[:, :-5].abs().sum(0) > 0).all()
        return
    assert (weight[:, -5:] == 0).all() and (weight[:, :-5].abs().sum(0) > 0).all()


def test_random_features_approximate_the_rbf_kernel():
    x = torch.randn(6, 8)
    method = Fed3RRandomFeatures(8, 2, rf_dim=40_000, rf_sigma=2.5, seed=7)
    phi = method.transform(x).to(torch.float64)
    kernel = torch.exp(-torch.cdist(x, x).to(torch.float64) ** 2 / (2 * 2.5**2))
    assert (phi @ phi.T - kernel).abs().max() < 6 / math.sqrt(40_000) * math.sqrt(2)
    same = Fed3RRandomFeatures(8, 2, rf_dim=40_000, rf_sigma=2.5, seed=7).transform(x)
    assert torch.equal(method.transform(x), same)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Fed3R(4, 2, lam=0.0), "--lam"),
        (lambda: Fed3R(4, 2, lam=-1.0), "--lam"),
        (lambda: FastFederatedCalibration(4, 2, lam=-1.0), "--lam must be ≥ 0 for FFC"),
        (lambda: FedCOF(4, 2, gamma=-0.1), "--gamma"),
        (lambda: FedCOF(4, 2, means_per_class=0), "--means-per-class"),
        (lambda: Fed3RRandomFeatures(4, 2, rf_dim=0), "--rf-dim"),
        (lambda: Fed3RRandomFeatures(4, 2, rf_sigma=0.0), "--rf-sigma"),
    ],
)
def test_bad_method_options_are_named(build, message):
    with pytest.raises(FedrayError, match=message):
        build()
